"""Paged attention on CPU with the compiled kernel (docs/adr/0001-compiled-cpu-decode-attention.md).

Every query row of the step goes to ``paged_attention`` from :mod:`kernels.cpu_kernels`, which attends
one row at a time over a prefix of its sequence's keys, read in place from the paged cache. A decode
token attends to all of its sequence's keys; row i of a prefill chunk after ``ctx`` cached tokens to
the first ``ctx + i + 1``, which is causal attention. Chunks used to go through torch's SDPA with an
explicit causal mask (the reference's path): a gather, a mask and a dozen small ops per chunk and
layer, 6.5% of the engine benchmark's run at 64 sequences, and 2.5-9x slower than the kernel even
for a 512-row chunk after 1536 cached tokens (the ADR's second addendum).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.attention_metadata import PagedAttentionMetadata


@dataclass
class CpuPlan:
    """The step's query rows for the kernel, built by the first layer and reused by the others."""

    seqs: torch.Tensor  # long [R]: each row's sequence
    rows: torch.Tensor  # long [R]: its row in q
    key_lens: torch.Tensor  # int32 [R]: how many of the sequence's first keys it attends to

    @classmethod
    def build(cls, m: PagedAttentionMetadata) -> CpuPlan:
        qsl, lens = m.query_start_loc_host, m.seq_lens_host
        seqs: list[int] = []
        rows: list[int] = []
        key_lens: list[int] = []
        for s, seq_len in enumerate(lens):
            q_len = qsl[s + 1] - qsl[s]
            seqs += [s] * q_len
            rows += range(qsl[s], qsl[s] + q_len)
            key_lens += range(seq_len - q_len + 1, seq_len + 1)
        return cls(
            seqs=torch.tensor(seqs, dtype=torch.long),
            rows=torch.tensor(rows, dtype=torch.long),
            key_lens=torch.tensor(key_lens, dtype=torch.int32),
        )


def paged_attention_cpu(
    compiled: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.attention.paged_attention`, for CPU tensors with q fp32 or of
    the caches' dtype (the kernel reads and writes q's dtype and computes in fp32).

    ``compiled`` is the module :func:`kernels.cpu_kernels.cpu_kernels` returned. The kernel writes
    into a contiguous buffer of q's dtype: ``out`` itself when it is one, else a scratch copied into
    ``out`` row by row afterwards (only rows of scheduled tokens, so others stay untouched).
    """
    plan = meta.cached_plan("cpu", lambda: CpuPlan.build(meta))
    result = torch.empty(q.shape, dtype=q.dtype) if out is None or not out.is_contiguous() else out
    if plan.rows.numel():
        compiled.paged_attention(
            q.contiguous(),
            k_cache.contiguous(),
            v_cache.contiguous(),
            meta.block_tables.contiguous(),
            plan.key_lens,
            plan.seqs,
            plan.rows,
            result,
            scale,
        )
    if out is not None and out is not result:
        out[plan.rows] = result[plan.rows]
        return out
    return result
