"""Rotary position embedding in the Llama/NeoX layout (rotate halves), applied in place to q and k.

The cos/sin table is ``[max_positions, head_dim]``: cosines in the first half, sines in the second.
It is computed in fp32 the way Hugging Face computes its per-position angles, so the reference
path reproduces its numbers.
"""

from __future__ import annotations

import torch

from kernels.cpu_kernels import cpu_kernels_for
from kernels.dispatch import use_triton


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """``[max_positions, 2 * len(inv_freq)]`` fp32 table for positions ``0 .. max_positions-1``."""
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate ``q [T, heads, head_dim]`` and ``k [T, kv_heads, head_dim]`` in place by ``positions [T]``."""
    if use_triton(q):
        from kernels.triton_rotary import apply_rotary_triton

        apply_rotary_triton(positions, q, k, cos_sin_cache)
        return
    unit_stride = q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.is_contiguous()
    fp32_table = cos_sin_cache.dtype == torch.float32 and cos_sin_cache.device.type == "cpu"
    if unit_stride and fp32_table and (compiled := cpu_kernels_for(q, k)) is not None:
        compiled.rotary(positions, q, k, cos_sin_cache)
        return
    apply_rotary_ref(positions, q, k, cos_sin_cache)


def apply_rotary_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x.copy_(rotated.to(x.dtype))
