"""The compiled fp32 projection kernel (kernels/csrc/dense_cpu.cpp) against a float64 GEMM.

Shapes cross every edge of the kernel's tiling on both builds: output columns that fill no, one or
several panels (32 columns on AVX-512, 16 on AVX2) with a ragged last one, a ragged second vector
included, row counts that split into balanced register tiles (AVX-512: 1-12 rows, 13 -> 7 + 6, 25 ->
9 + 8 + 8; AVX2: 1-6 rows, 7 -> 3 + 4, 13 -> 4 + 4 + 5) and the prefetch modes that go with them, a
panel count that does not split evenly over the threads, with and without bias. Outputs start as
NaN, so a cell the kernel skips fails.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.cpu_kernels import cpu_kernels
from kernels.dense import gated_linear, pack_gated_weight, pack_weight, packed_linear


@pytest.fixture(scope="module")
def module() -> ModuleType:
    compiled = cpu_kernels()
    assert compiled is not None, "the CPU kernels did not build on this machine"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        assert not compiled.dense_available()
        pytest.skip(
            "the compiled dense kernel exists only in the AVX-512 and AVX2 builds (oneDNN serves this CPU)"
        )
    assert compiled.dense_available()
    return compiled


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("out_features", [5, 32, 45, 96, 161])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 12, 13, 25, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(module: ModuleType, out_features: int, rows: int, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(out_features * 1000 + rows)
    in_features = 37
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g)
    packed = pack_weight(w)
    assert packed is not None
    out = torch.full((rows, out_features), float("nan"))
    module.dense_cpu(x, packed.panels, torch.empty(0) if b is None else b, out)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert _relative_error(out, want) < 1e-6


def test_leading_dims_and_strided_input(module: ModuleType) -> None:
    """packed_linear takes [..., in] (a transposed, non-contiguous view included) like F.linear."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 48, generator=g)
    x = torch.randn(48, 3, 4, generator=g).permute(1, 2, 0)  # [3, 4, 48], not contiguous
    got = packed_linear(x, pack_weight(w))
    assert got.shape == (3, 4, 70)
    assert _relative_error(got, x.double() @ w.double().t()) < 1e-6
    assert packed_linear(torch.empty(0, 48), pack_weight(w)).shape == (0, 70)


def test_refuses_what_it_cannot_serve(module: ModuleType) -> None:
    assert pack_weight(torch.randn(8, 8, dtype=torch.bfloat16)) is None  # bf16 stays with oneDNN
    with pytest.raises(ValueError, match="x has 9 features, the weight takes 8"):
        packed_linear(torch.randn(2, 9), pack_weight(torch.randn(4, 8)))


@pytest.mark.parametrize("panels", [1, 3, 5])
@pytest.mark.parametrize("rows", [1, 6, 7, 13, 25])
def test_gated_pairs_match_float64(module: ModuleType, panels: int, rows: int) -> None:
    """silu(gate) * up from the paired panels, and the split product, against float64; outputs start
    as NaN. Intermediate sizes of 1, 3 and 5 vectors (more panels than threads, unevenly)."""
    inter = panels * module.dense_gate_width()
    g = torch.Generator().manual_seed(panels * 100 + rows)
    w = torch.randn(2 * inter, 40, generator=g) / 4
    x = torch.randn(rows, 40, generator=g)
    paired = pack_gated_weight(w)
    assert paired is not None and paired.intermediate == inter
    gate, up = x.double() @ w[:inter].double().t(), x.double() @ w[inter:].double().t()
    act = torch.full((rows, inter), float("nan"))
    module.dense_gated_cpu(x, paired.panels, act, False)
    assert _relative_error(act, torch.nn.functional.silu(gate) * up) < 1e-6
    both = torch.full((rows, 2 * inter), float("nan"))
    module.dense_gated_cpu(x, paired.panels, both, True)
    assert _relative_error(both, torch.cat([gate, up], dim=1)) < 1e-6
    assert torch.equal(gated_linear(x.view(rows, 1, 40), paired).view(rows, inter), act)


def test_gated_packing_refuses_what_it_cannot_pair(module: ModuleType) -> None:
    width = module.dense_gate_width()
    assert pack_gated_weight(torch.randn(2 * width + 2, 8)) is None  # intermediate not whole vectors
    assert pack_gated_weight(torch.randn(2 * width + 1, 8)) is None  # not two halves
    assert pack_gated_weight(torch.randn(2 * width, 8, dtype=torch.bfloat16)) is None
    with pytest.raises(ValueError, match="x has 9 features, the weight takes 8"):
        gated_linear(torch.randn(2, 9), pack_gated_weight(torch.randn(2 * width, 8)))
