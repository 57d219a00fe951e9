"""The paged-attention dispatch point: one call for prefill chunks and decode tokens of a flat batch.

Three implementations share one contract (the batch layout is in :mod:`kernels.attention_metadata`):

* Triton (:mod:`kernels.triton_attention`) on CUDA tensors, or anywhere when forced
  (:func:`kernels.force_triton`, ``LOOM_FORCE_TRITON``); imported on first use, so CPU-only callers
  never import Triton;
* the compiled CPU kernel (:mod:`kernels.attention_cpu`; decodes and prefill chunks) for CPU
  tensors, q fp32 or of the caches' dtype, when it built;
* the torch reference (:mod:`kernels.attention_ref`) otherwise.
"""

from __future__ import annotations

import torch

from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_metadata import PagedAttentionMetadata
from kernels.attention_ref import paged_attention_ref
from kernels.cpu_kernels import cpu_kernels
from kernels.dispatch import use_triton


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q [num_tokens, num_heads, head_dim]`` over the paged cache; same shape out.

    ``out`` (optional, ``[num_tokens, num_heads, head_dim]`` in q's dtype) receives the result
    instead of a fresh tensor; rows of tokens outside every sequence are left untouched.
    """
    if use_triton(q):
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, out)
    # fp32, or a half-precision model's q over its own cache dtype: the kernel computes in fp32.
    on_cpu = q.device.type == "cpu" and q.dtype in (torch.float32, k_cache.dtype)
    if on_cpu and (compiled := cpu_kernels()) is not None:
        return paged_attention_cpu(compiled, q, k_cache, v_cache, meta, scale, out)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, out)
