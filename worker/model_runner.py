"""Builds the flat varlen batch of one step, runs the model and samples the next tokens."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from kernels import PagedAttentionMetadata
from kernels.argmax import argmax_rows
from protocol.requests import TokenLogprob
from worker.grammars import Grammars
from worker.kv_cache import KVCache
from worker.lora_slots import LoraSlots
from worker.model import ForwardBatch, LlamaModel, LoraStep
from worker.rejection_sampler import verify
from worker.sampler import RequestRng, RowFailed, sample, token_logprobs
from worker.scheduler import ScheduledBatch
from worker.sequence import Sequence


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardBatch:
    """Inputs for ``batch``: each sequence's next ``n`` tokens, their positions and cache slots. A row
    verifying proposals takes them as its last tokens and wants logits at each of its positions."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        start = seq.num_computed_tokens
        end = start + n
        spec = batch.spec.get(seq)
        if spec:
            input_ids.extend(seq.token_ids[start:])
            input_ids.extend(spec)
            logits_rows.extend(range(len(input_ids) - len(spec) - 1, len(input_ids)))
        else:
            input_ids.extend(seq.token_ids[start:end])
            if end == seq.num_tokens:  # the chunk reaches the last token: its logits give the next one
                logits_rows.append(len(input_ids) - 1)
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(table)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=t(input_ids),
        positions=t(positions),
        slot_mapping=t(slots),
        attention=PagedAttentionMetadata.build(query_lens, seq_lens, tables, device),
        logits_indices=t(logits_rows),
    )


@dataclass
class StepOutput:
    """What a forward step produced: tokens, and the sequences that got none (non-finite logits, a
    sampling error) with the reason."""

    sampled: dict[Sequence, int] = field(default_factory=dict)
    accepted: dict[Sequence, list[int]] = field(default_factory=dict)  # held proposals, before sampled
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # rows without a token, and why
    # For requests that asked: one per token gained (accepted proposals, then the sampled one).
    logprobs: dict[Sequence, list[TokenLogprob]] = field(default_factory=dict)
    forward_s: float = 0.0  # the model's forward pass alone
    grammar_s: float = 0.0  # filling the constrained rows' token masks


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        lora: LoraSlots | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.lora = lora
        self.grammars = grammars
        # A sampled sequence's random stream lives as long as the sequence, and no longer.
        self._rngs: weakref.WeakKeyDictionary[Sequence, RequestRng] = weakref.WeakKeyDictionary()

    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step: the sampled token of every sequence whose chunk reached its end."""
        fb = build_forward_batch(batch, self.kv.block_size, self.model.device)
        if self.lora is not None and (tokens := self.lora.batch(batch.seqs, batch.num_tokens)) is not None:
            fb.lora = LoraStep(tokens, self.lora)
        started = time.perf_counter()
        logits = self.model.forward(fb, self.kv.k, self.kv.v)
        forward_s = time.perf_counter() - started
        sampled_seqs = [
            s
            for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            if s.num_computed_tokens + n == s.num_tokens + len(batch.spec.get(s, ()))
        ]
        out = StepOutput(forward_s=forward_s)
        if not sampled_seqs:
            return out
        if not batch.spec:
            self._sample(logits, sampled_seqs, out)
            return out
        # Rows verifying proposals own several logits rows each; the rest one.
        first: list[int] = []
        at = 0
        for seq in sampled_seqs:
            first.append(at)
            at += len(batch.spec.get(seq, ())) + 1
        plain = [j for j, seq in enumerate(sampled_seqs) if seq not in batch.spec]
        if plain:
            rows = torch.tensor([first[j] for j in plain], dtype=torch.long, device=logits.device)
            self._sample(logits.index_select(0, rows), [sampled_seqs[j] for j in plain], out)
        picks, finite = argmax_rows(logits)
        pick_of, finite_of = picks.tolist(), finite.tolist()
        for j, seq in enumerate(sampled_seqs):
            spec = batch.spec.get(seq)
            if spec is None:
                continue
            lo, hi = first[j], first[j] + len(spec) + 1
            try:
                gained = verify(
                    logits[lo:hi],
                    pick_of[lo:hi],
                    all(finite_of[lo:hi]),
                    spec,
                    seq.sampling,
                    None if seq.sampling.greedy else self._rng(seq),
                    seq.num_tokens,
                )
            except Exception as exc:  # this row's values, never the batch's problem
                gained = RowFailed(f"sampling failed for this request ({type(exc).__name__})")
            if isinstance(gained, RowFailed):
                out.failed.append((seq, gained.reason))
                continue
            out.accepted[seq], out.sampled[seq] = gained[:-1], gained[-1]
            if seq.sampling.logprobs is not None:
                top = [seq.sampling.logprobs] * len(gained)
                out.logprobs[seq] = token_logprobs(logits, list(range(lo, lo + len(gained))), gained, top)
        return out

    def _sample(self, logits: torch.Tensor, sampled_seqs: list[Sequence], out: StepOutput) -> None:
        """One token for each of ``sampled_seqs`` from its row of ``logits``."""
        params = [s.sampling for s in sampled_seqs]
        rngs = [None if p.greedy else self._rng(s) for s, p in zip(sampled_seqs, params, strict=True)]
        masked = time.perf_counter()
        masks = self.grammars.masks(sampled_seqs) if self.grammars is not None else None
        out.grammar_s = time.perf_counter() - masked
        wants_lp = [row for row, s in enumerate(sampled_seqs) if s.sampling.logprobs is not None]
        # Log-probabilities are the model's, before any mask: the rows that ask keep a copy when a
        # mask may write into the logits.
        lp_logits = logits.index_select(0, torch.tensor(wants_lp)) if masks is not None and wants_lp else None
        rows: list[int] = []
        for row, (seq, token) in enumerate(
            zip(
                sampled_seqs,
                sample(logits, params, rngs, masks, [s.num_tokens for s in sampled_seqs]),
                strict=True,
            )
        ):
            if isinstance(token, RowFailed):
                out.failed.append((seq, token.reason))
                continue
            out.sampled[seq] = token
            if seq.sampling.logprobs is not None:
                rows.append(row)
        if rows:
            seqs = [sampled_seqs[r] for r in rows]
            picked = [out.sampled[s] for s in seqs]
            tops = [s.sampling.logprobs or 0 for s in seqs]
            source, at = (
                (logits, rows) if lp_logits is None else (lp_logits, [wants_lp.index(r) for r in rows])
            )
            for seq, lp in zip(seqs, token_logprobs(source, at, picked, tops), strict=True):
                out.logprobs[seq] = [lp]

    def _rng(self, seq: Sequence) -> RequestRng:
        rng = self._rngs.get(seq)
        if rng is None:
            rng = self._rngs[seq] = RequestRng(seq.sampling.seed)
        return rng
