"""The compiled CPU layer ops (kernels/csrc/layer_ops_cpu.cpp): residual add + RMSNorm, SiLU-and-mul and
rotary, against their torch references and float64, with fresh random inputs and outputs poisoned
with NaN (a row the kernel skips stays NaN and fails the comparison); in fp32 and in bf16."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_test_utils import rel_err

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.cpu_kernels import cpu_kernels
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache

NONE = torch.empty(0)


@pytest.fixture(scope="module")
def compiled() -> ModuleType:
    module = cpu_kernels()
    assert module is not None, "the CPU kernels did not build on this machine"
    return module


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rms_norm_with_and_without_residual(compiled: ModuleType, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    d, eps = 96, 1e-5
    x, res = torch.randn(rows, d, generator=g) * 3, torch.randn(rows, d, generator=g)
    w = torch.randn(d, generator=g)
    x0, res0 = x.clone(), res.clone()
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    compiled.rms_norm(x, w, eps, res, res_out, out)
    s = x.double() + res.double()
    want = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    assert rel_err(out, want) < 1e-6 and rel_err(res_out, s) < 1e-7
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    plain = torch.full_like(x, float("nan"))
    compiled.rms_norm(x, w, eps, NONE, NONE, plain)
    want_plain = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)
    assert rel_err(plain, want_plain) < 1e-6
    # the dispatcher takes the compiled path and keeps the reference's contract
    got, got_res = rms_norm(x, w, eps, res)
    ref, ref_res = rms_norm_ref(x, w, eps, res)
    assert rel_err(got, ref.double()) < 1e-6 and torch.equal(got_res, ref_res)
    assert rel_err(rms_norm(x, w, eps), rms_norm_ref(x, w, eps).double()) < 1e-6


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_and_mul(compiled: ModuleType, rows: int) -> None:
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 2 * 80, generator=g) * 4
    out = torch.full((rows, 80), float("nan"))
    compiled.silu_and_mul(x, out)
    gate, up = x[:, :80].double(), x[:, 80:].double()
    want = gate * torch.sigmoid(gate) * up
    assert rel_err(out, want) < 1e-6
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x).double()) < 1e-6


@pytest.mark.parametrize("rows", [1, 6, 19])
def test_rotary_in_place_on_views_of_a_fused_projection(compiled: ModuleType, rows: int) -> None:
    g = torch.Generator().manual_seed(200 + rows)
    heads, kv_heads, hd = 4, 2, 16
    cos_sin = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 512)
    positions = torch.randint(0, 512, (rows,), generator=g)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g)
    q = qkv[:, : heads * hd].view(rows, heads, hd)  # strided rows, as in the model
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd)
    v_before = qkv[:, (heads + kv_heads) * hd :].clone()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(positions, q_ref, k_ref, cos_sin)
    q64, k64 = q.double().clone(), k.double().clone()
    cs = cos_sin.double()[positions]
    cos, sin = cs[:, None, : hd // 2], cs[:, None, hd // 2 :]
    for t in (q64, k64):
        x1, x2 = t[..., : hd // 2].clone(), t[..., hd // 2 :].clone()
        t[..., : hd // 2], t[..., hd // 2 :] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    apply_rotary(positions, q, k, cos_sin)
    assert rel_err(q, q64) < 1e-6 and rel_err(k, k64) < 1e-6
    assert rel_err(q, q_ref.double()) < 1e-6
    assert torch.equal(qkv[:, (heads + kv_heads) * hd :], v_before)  # v untouched


def _ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance, in bf16 units in the last place, between two bf16 tensors."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    return int((a - b).abs().max())


def test_bf16_rounds_where_the_bf16_reference_rounds(compiled: ModuleType) -> None:
    """bf16 in, fp32 inside, rounded at the reference's points: at most one bf16 ulp from it (fp32
    evaluation order differs), close to float64, and the dispatchers take the compiled path."""
    g = torch.Generator().manual_seed(7)
    rows, d = 9, 96
    x = (torch.randn(rows, d, generator=g) * 3).bfloat16()
    res = torch.randn(rows, d, generator=g).bfloat16()
    w = torch.randn(d, generator=g).bfloat16()
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    compiled.rms_norm(x, w, 1e-5, res, res_out, out)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(res_out, ref_res) and _ulps(out, ref) <= 1
    s = x.double() + res.double()
    assert rel_err(out, w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)) < 1e-2
    got, got_res = rms_norm(x, w, 1e-5, res)
    assert torch.equal(got, out) and torch.equal(got_res, res_out)

    gu = (torch.randn(rows, 2 * 80, generator=g) * 4).bfloat16()
    act = torch.full((rows, 80), float("nan"), dtype=torch.bfloat16)
    compiled.silu_and_mul(gu, act)
    # two rounding points (after SiLU, after the product), each at most one ulp from torch's SiLU,
    # whose exp differs per CPU: a 1-ulp SiLU difference times the up value can round 2 ulps apart
    # (seen on an AVX512-FP16 Xeon; the AMD EPYC matched within 1)
    assert _ulps(act, silu_and_mul_ref(gu)) <= 2
    g64, u64 = gu[:, :80].double(), gu[:, 80:].double()
    assert rel_err(act, g64 / (1 + torch.exp(-g64)) * u64) < 1e-2
    assert torch.equal(silu_and_mul(gu), act)

    heads, kv_heads, hd = 4, 2, 16
    cos_sin = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), 64)
    positions = torch.randint(0, 64, (rows,), generator=g)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=g).bfloat16()
    q = qkv[:, : heads * hd].view(rows, heads, hd)
    k = qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(positions, q_ref, k_ref, cos_sin)
    apply_rotary(positions, q, k, cos_sin)
    assert _ulps(q, q_ref) <= 1 and _ulps(k, k_ref) <= 1


def test_mixed_or_other_dtypes_keep_the_reference(compiled: ModuleType) -> None:
    x = torch.randn(3, 32, dtype=torch.float16)
    w = torch.randn(32, dtype=torch.float16)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))
    xb, wf = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(32)  # bf16 rows, fp32 weight
    assert torch.equal(rms_norm(xb, wf, 1e-6), rms_norm_ref(xb, wf, 1e-6))
    with pytest.raises(RuntimeError, match="weight must be"):
        compiled.rms_norm(xb, wf, 1e-6, NONE, NONE, torch.empty_like(xb))
