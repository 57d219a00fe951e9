"""Writes a step's new keys and values into the paged caches, one slot per token.

``slot = block * block_size + offset``; a slot of -1 marks a token whose KV is not stored (padding,
or a token whose block is already filled from the prefix cache) and is skipped.
"""

from __future__ import annotations

import torch

from kernels.cpu_kernels import cpu_kernels_for
from kernels.dispatch import use_triton


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value [num_tokens, kv_heads, head_dim]`` at ``slot_mapping [num_tokens]``."""
    if use_triton(key):
        from kernels.triton_kv_write import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    rows_ok = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (key, value))
    caches_ok = k_cache.is_contiguous() and v_cache.is_contiguous()
    if rows_ok and caches_ok and (compiled := cpu_kernels_for(key, value, k_cache, v_cache)) is not None:
        compiled.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
