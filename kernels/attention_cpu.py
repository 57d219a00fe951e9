"""Paged attention on CPU with the compiled decode kernel (docs/adr/0001-compiled-cpu-decode-attention.md).

Decode rows go to ``paged_decode`` from :mod:`kernels.cpu_kernels`, which reads each sequence's keys
and values in place, once, instead of gathering them into padded buffers as the reference does.
Prefill chunks are GEMM-bound and keep the reference's SDPA path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.attention_metadata import PagedAttentionMetadata
from kernels.attention_ref import chunks_ref, reference_plan


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
    plan = reference_plan(meta, k_cache.shape[1])
    result = torch.empty(q.shape, dtype=q.dtype) if out is None or not out.is_contiguous() else out
    if plan.decode_rows.numel():
        compiled.paged_decode(
            q.contiguous(),
            k_cache.contiguous(),
            v_cache.contiguous(),
            meta.block_tables.contiguous(),
            meta.seq_lens.contiguous(),
            plan.decode_seqs,
            plan.decode_rows,
            result,
            scale,
        )
    chunks_ref(q, k_cache, v_cache, plan, scale, result)
    if out is not None and out is not result:
        rows = torch.cat([plan.decode_rows, *(torch.arange(r, r + n) for r, n, _ in plan.chunks)])
        out[rows] = result[rows]
        return out
    return result
