"""The per-step description of a flat varlen batch that every paged-attention path reads.

Each sequence ``s`` contributes the query rows ``query_start_loc[s]:query_start_loc[s+1]``; its
``seq_lens[s]`` counts every token it has, cached context included, so the new chunk occupies the
last ``q_len`` positions and is causal inside itself. Keys and values are read from the paged cache
``[num_blocks, block_size, num_kv_heads, head_dim]`` through ``block_tables[s]``.

This module depends on torch only, so the reference, the compiled CPU path and the Triton kernel
can all import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch

_PlanT = TypeVar("_PlanT")


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs to know about one step's flat batch (built once per step)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the compute device
    seq_lens: torch.Tensor  # int32 [num_seqs], on the compute device
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], on the compute device
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU paths can plan without a device sync per layer.
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    # Triton split-KV override: None lets choose_num_kv_splits decide, 1 forces the single pass.
    kv_splits: int | None = None
    # (key, plan) of the last cached_plan call; see cached_plan.
    _plan: tuple[Hashable, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """Build the metadata from host lists; block tables are padded with 0 (never read)."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        width = max((len(t) for t in block_tables), default=0) or 1
        # Filled through numpy: a torch tensor per row cost ~5 us, 1.4 ms at 256 sequences (0.12 here).
        host = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            host[i, : len(t)] = t
        table = torch.from_numpy(host)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=qsl,
            seq_lens_host=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def cached_plan(self, key: Hashable, build: Callable[[], _PlanT]) -> _PlanT:
        """``build()``, computed on the first call for ``key`` and returned again to later layers.

        The metadata lives exactly one step and is passed to every layer, so a plan derived from it
        (the reference path's gather indices, see :mod:`kernels.attention_ref`) is kept here and built
        once per step instead of once per layer. Only the latest key is kept: one step uses one cache
        block size.
        """
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, build())
        return cast(_PlanT, self._plan[1])
