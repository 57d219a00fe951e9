"""Triton rotary embedding (Llama/NeoX "rotate halves" layout), in place on q and k.

One program per token rotates every query head and every key head of that token, so the
token's cos/sin row is loaded once. Head tiles are ``[heads, head_dim / 2]``; each element is read
and written by the same program, which makes the in-place update safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast_to, interpreting, next_pow2


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)
    d = tl.arange(0, HALF_P)
    ok = (heads < num_heads)[:, None] & (d < HALF)[None, :]
    p1 = x_ptr + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(p1, cast_to(x1 * cos[None, :] - x2 * sin[None, :], dtype, INTERPRET), mask=ok)
    tl.store(p1 + HALF, cast_to(x2 * cos[None, :] + x1 * sin[None, :], dtype, INTERPRET), mask=ok)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    QH_P: tl.constexpr,
    KH_P: tl.constexpr,
    HALF_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_P)
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, QH_P, HALF_P, INTERPRET)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, HALF, KH_P, HALF_P, INTERPRET)


def apply_rotary_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate ``q [T, heads, head_dim]`` and ``k [T, kv_heads, head_dim]`` in place.

    ``q`` and ``k`` may be strided views (e.g. slices of a fused QKV output) as long as the
    head_dim axis is contiguous, which is what makes the update land in the caller's tensor.
    """
    num_tokens = q.shape[0]
    half = cos_sin_cache.shape[-1] // 2
    if q.shape[-1] != 2 * half or k.shape[-1] != 2 * half:
        raise ValueError(f"rotary table covers {2 * half} dims, heads have {q.shape[-1]}/{k.shape[-1]}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary_triton needs a contiguous head_dim axis (it updates in place)")
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        QH_P=next_pow2(q.shape[1]),
        KH_P=next_pow2(k.shape[1]),
        HALF_P=next_pow2(half),
        INTERPRET=interpreting(),
        num_warps=4,
    )
