"""SiLU-and-mul: the gated MLP activation ``silu(gate) * up`` over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import cpu_kernels_for
from kernels.dispatch import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [num_tokens, 2 * d]`` (gate then up) -> ``[num_tokens, d]``."""
    if use_triton(x):
        from kernels.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    if x.is_contiguous() and x.dim() == 2 and (compiled := cpu_kernels_for(x)) is not None:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
        compiled.silu_and_mul(x, out)
        return out
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
