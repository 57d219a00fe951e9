"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

from typing import overload

import torch

from kernels.cpu_kernels import cpu_kernels_for
from kernels.dispatch import use_triton


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``; with ``residual``, ``norm(x + residual)`` and the updated residual ``x + residual``."""
    if use_triton(x):
        from kernels.triton_rmsnorm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if all(t.is_contiguous() for t in tensors) and (compiled := cpu_kernels_for(*tensors)) is not None:
        out = torch.empty_like(x)
        if residual is None:
            compiled.rms_norm(x, weight, eps, _NONE, _NONE, out)
            return out
        residual_out = torch.empty_like(x)
        compiled.rms_norm(x, weight, eps, residual, residual_out, out)
        return out, residual_out
    return rms_norm_ref(x, weight, eps, residual)


_NONE = torch.empty(0)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
