"""Builds the flat varlen batch of one step, runs the model and samples the next tokens."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from kernels import PagedAttentionMetadata
from protocol.requests import TokenLogprob
from worker.grammars import Grammars
from worker.kv_cache import KVCache
from worker.lora_slots import LoraSlots
from worker.model import ForwardBatch, LlamaModel, LoraStep
from worker.sampler import RequestRng, RowFailed, sample, token_logprobs
from worker.scheduler import ScheduledBatch
from worker.sequence import Sequence


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> ForwardBatch:
    """Inputs for ``batch``: each sequence's next ``n`` tokens, their positions and cache slots."""
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
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        if end == seq.num_tokens:  # the chunk reaches the last token: its logits give the next one
            logits_rows.append(len(input_ids) - 1)
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
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # rows without a token, and why
    logprobs: dict[Sequence, TokenLogprob] = field(default_factory=dict)  # for requests that asked
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
            if s.num_computed_tokens + n == s.num_tokens
        ]
        out = StepOutput(forward_s=forward_s)
        if not sampled_seqs:
            return out
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
            zip(sampled_seqs, sample(logits, params, rngs, masks), strict=True)
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
            out.logprobs = dict(zip(seqs, token_logprobs(source, at, picked, tops), strict=True))
        return out

    def _rng(self, seq: Sequence) -> RequestRng:
        rng = self._rngs.get(seq)
        if rng is None:
            rng = self._rngs[seq] = RequestRng(seq.sampling.seed)
        return rng
