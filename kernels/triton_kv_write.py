"""Triton KV write: scatter one step's new keys and values into the paged caches by slot.

One program per token copies all of that token's KV heads (a ``[kv_heads, head_dim]`` tile) for
both K and V; a negative slot (-1) masks the stores, so skipped tokens cost one scalar load.
Slot offsets are computed in int64 because a large cache overflows int32 element offsets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast_to, interpreting, next_pow2


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_P)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)  # a skipped token stores nothing
    ok = (heads < live_heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    k_dst = k_cache_ptr + slot * stride_kc_slot + heads[:, None] * stride_kc_head + d[None, :]
    v_dst = v_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_head + d[None, :]
    tl.store(k_dst, cast_to(k.to(tl.float32), k_cache_ptr.dtype.element_ty, INTERPRET), mask=ok)
    tl.store(v_dst, cast_to(v.to(tl.float32), v_cache_ptr.dtype.element_ty, INTERPRET), mask=ok)


def _slot_strides(cache: torch.Tensor) -> tuple[int, int]:
    """Element strides of (flat slot, kv head) for ``[num_blocks, block_size, kv_heads, head_dim]``."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(-1) != 1:
        raise ValueError("KV cache blocks must be laid out slot after slot with a contiguous head_dim")
    return cache.stride(1), cache.stride(2)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value [T, kv_heads, head_dim]`` at ``slot_mapping [T]`` (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    kc_slot, kc_head = _slot_strides(k_cache)
    vc_slot, vc_head = _slot_strides(v_cache)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kc_slot,
        kc_head,
        vc_slot,
        vc_head,
        HEAD_DIM=head_dim,
        HEADS_P=next_pow2(num_kv_heads),
        HEAD_P=next_pow2(head_dim),
        INTERPRET=interpreting(),
        num_warps=4,
    )
