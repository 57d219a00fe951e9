"""A draft model's proposals: a smaller model of the same vocabulary guesses each row's next tokens.

The draft runs greedily, ``room`` steps ahead, every row of the step in one batch: first each row's
tokens it has not seen yet (its whole prompt the first time, afterwards what the row gained since),
then one token a step. Its K/V live in a paged cache of its own, with a block table per row kept
here; a row gives its blocks back once it stops running (finished, aborted or preempted), and the
draft catches up on its tokens if it runs again. Adapters are ignored: the draft proposes for the
base model, and the target verifies with the row's adapter, so a wrong guess costs only its slot.

A greedy draft is a one-point proposal distribution, which is what the rejection sampler verifies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kernels import PagedAttentionMetadata
from kernels.argmax import argmax_rows
from worker.checkpoint import Checkpoint
from worker.kv_cache import KVCache
from worker.model import ForwardBatch, LlamaModel
from worker.sequence import Sequence, SequenceStatus


@dataclass
class _Row:
    table: list[int] = field(default_factory=list)
    computed: int = 0  # leading positions whose draft K/V are in the cache


class DraftProposer:
    def __init__(
        self,
        checkpoint: Checkpoint,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = LlamaModel(checkpoint.config, checkpoint.weights, dtype, device)
        self.kv = KVCache.allocate(checkpoint.config, num_blocks, block_size, dtype, device)
        self.block_size = block_size
        self.device = device
        self._free: deque[int] = deque(range(num_blocks))
        self._rows: dict[Sequence, _Row] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        self._release_stopped()
        guesses: list[list[int]] = [[] for _ in seqs]
        active = [
            i for i, (seq, n) in enumerate(zip(seqs, room, strict=True)) if n > 0 and self._reserve(seq, n)
        ]
        if not active:
            return guesses
        # Step 0: what each row has not run through the draft yet, up to its last token.
        inputs = {i: seqs[i].token_ids[self._rows[seqs[i]].computed :] for i in active}
        starts = {i: self._rows[seqs[i]].computed for i in active}
        for i in active:
            self._rows[seqs[i]].computed = seqs[i].num_tokens
        while active:
            picks = self._step(
                [seqs[i] for i in active], [inputs[i] for i in active], [starts[i] for i in active]
            )
            for i, token in zip(active, picks, strict=True):
                guesses[i].append(token)
                starts[i] += len(inputs[i])
                inputs[i] = [token]
            active = [i for i in active if len(guesses[i]) < room[i]]
        return guesses

    def _step(self, seqs: list[Sequence], inputs: list[list[int]], starts: list[int]) -> list[int]:
        """One draft forward over each row's ``inputs`` at positions from ``starts``: each row's
        greedy next token."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        tables = []
        for seq, tokens, start in zip(seqs, inputs, starts, strict=True):
            table = self._rows[seq].table
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += (table[p // bs] * bs + p % bs for p in range(start, start + len(tokens)))
            last.append(len(ids) - 1)
            tables.append(table)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=self.device)

        batch = ForwardBatch(
            input_ids=t(ids),
            positions=t(positions),
            slot_mapping=t(slots),
            attention=PagedAttentionMetadata.build(
                [len(x) for x in inputs],
                [s + len(x) for s, x in zip(starts, inputs, strict=True)],
                tables,
                self.device,
            ),
            logits_indices=t(last),
        )
        logits = self.model.forward(batch, self.kv.k, self.kv.v)
        picks, _ = argmax_rows(logits)
        return picks.tolist()

    def _reserve(self, seq: Sequence, room: int) -> bool:
        """Blocks for ``seq``'s tokens and ``room - 1`` guesses fed back; False (no guess this step)
        when the draft's cache has too few free."""
        row = self._rows.setdefault(seq, _Row())
        need = -(-(seq.num_tokens + room - 1) // self.block_size) - len(row.table)
        if need > len(self._free):
            return False
        row.table += (self._free.popleft() for _ in range(max(need, 0)))
        return True

    def _release_stopped(self) -> None:
        for seq in [s for s in self._rows if s.status is not SequenceStatus.RUNNING]:
            self._free.extend(self._rows.pop(seq).table)
