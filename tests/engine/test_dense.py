"""Dense projections: the packed paths (the compiled kernel in fp32 on AVX-512 and AVX2, oneDNN
otherwise) equal a float64 GEMM, in fp32 and (natively) bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_kernels import cpu_kernels
from worker.dense import Dense


@pytest.mark.parametrize("rows", [1, 8, 37, 64])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_projection_matches_float64(rows: int, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    dense = Dense(w, b)
    want = x.double() @ w.double().t() + b.double()
    got = dense(x).double()
    assert ((got - want).norm() / want.norm()).item() < tol
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    compiled = cpu_kernels() is not None and cpu_kernels().dense_available()
    # fp32: the compiled kernel where it was built, else oneDNN; bf16: oneDNN only where the CPU
    # computes it natively (else it would be slower). Never the plain copy beside a packed one.
    assert (dense._panels is not None) == (dtype == torch.float32 and compiled)
    assert (dense._packed is not None) == (
        (dtype == torch.bfloat16 and native_bf16) or (dtype == torch.float32 and not compiled)
    )
    assert (dense._weight is None) == (dense._panels is not None or dense._packed is not None)


@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gated_projection_and_its_activation(rows: int, dtype: torch.dtype, tol: float) -> None:
    """A gated [gate; up] projection gives the plain product and silu(gate) * up, fused or not."""
    g = torch.Generator().manual_seed(100 + rows)
    inter = 64
    w = (torch.randn(2 * inter, 48, generator=g) / 4).to(dtype)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    dense = Dense(w, gated=True)
    gate, up = x.double() @ w[:inter].double().t(), x.double() @ w[inter:].double().t()
    want = torch.nn.functional.silu(gate) * up
    got_act, got_both = dense.silu_mul(x).double(), dense(x).double()
    assert ((got_act - want).norm() / want.norm()).item() < tol
    both = torch.cat([gate, up], dim=1)
    assert ((got_both - both).norm() / both.norm()).item() < tol
    compiled = cpu_kernels() is not None and cpu_kernels().dense_available()
    assert (dense._gated is not None) == (dtype == torch.float32 and compiled)  # fused where it can be
