"""Shared helpers for the kernel tests: device choice, tolerances, error metric, NaN poisoning."""

from __future__ import annotations

import torch

from kernels.settings import KernelSettings

# On a CUDA machine without the interpreter the tests drive the compiled kernels on the GPU;
# otherwise CPU tensors go through the interpreter (conftest sets TRITON_INTERPRET=1).
DEVICE = "cuda" if torch.cuda.is_available() and not KernelSettings().triton_interpret else "cpu"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tol(dtype: torch.dtype) -> float:
    """Allowed relative error: fp32 paths must agree to 1e-5, half-precision ones to 1e-2."""
    return 1e-5 if dtype == torch.float32 else 1e-2


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64; NaN anywhere counts as infinite."""
    a, e = actual.double().cpu(), expected.double().cpu()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A destination full of NaN, so any element a kernel forgets to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
