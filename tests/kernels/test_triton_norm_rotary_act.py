"""RMSNorm (+ residual), rotary embedding and SiLU-and-mul: Triton vs torch reference vs float64.

Outputs are NaN-poisoned before each launch; rotary works in place, so q and k are views into a fused
buffer whose other heads hold sentinel values that must come out bit-for-bit unchanged.
"""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import DEVICE, DTYPES, poisoned, randn, rel_err, tol

from kernels import apply_rotary, build_cos_sin_cache, force_triton, rms_norm, silu_and_mul
from kernels.activation import silu_and_mul_ref
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import apply_rotary_ref
from kernels.triton_activation import silu_and_mul_triton
from kernels.triton_rmsnorm import rms_norm_triton


def rms_norm_f64(x, weight, eps, residual=None):
    h = x.double() + (residual.double() if residual is not None else 0.0)
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return out, h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(hidden + with_residual)
    rows = 7
    x = randn(gen, rows, hidden, dtype=dtype) * 3
    weight = randn(gen, hidden, dtype=dtype)
    residual = randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    out = poisoned((rows, hidden), dtype)
    res_out = poisoned((rows, hidden), dtype)
    with force_triton():
        got = rms_norm_triton(x, weight, 1e-5, residual, out=out, residual_out=res_out)
    ref = rms_norm_ref(x, weight, 1e-5, residual)
    expected, expected_res = rms_norm_f64(x, weight, 1e-5, residual)
    if with_residual:
        assert got[0] is out and got[1] is res_out
        assert torch.equal(res_out, ref[1]), "x + residual must round exactly like torch"
        assert rel_err(ref[1], expected_res) < tol(dtype)
        ref = ref[0]
    assert rel_err(ref, expected) < tol(dtype)
    assert rel_err(out, ref) < tol(dtype)
    assert rel_err(out, expected) < tol(dtype)


def test_rms_norm_dispatch_3d_input() -> None:
    gen = torch.Generator().manual_seed(0)
    x, r, w = randn(gen, 2, 3, 64), randn(gen, 2, 3, 64), randn(gen, 64)
    with force_triton():
        out, res = rms_norm(x, w, 1e-6, r)
        plain = rms_norm(x, w, 1e-6)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, r)
    assert out.shape == x.shape and rel_err(out, ref_out) < 1e-5 and rel_err(res, ref_res) < 1e-5
    assert rel_err(plain, rms_norm_ref(x, w, 1e-6)) < 1e-5


def rotary_f64(positions, x, cos_sin):
    cs = cos_sin.double().cpu()[positions.long().cpu()]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = x.double().cpu()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 16), (9, 3, 64)])
def test_rotary_in_place(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    max_pos, tokens = 4096, 11
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, max_pos).to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    positions[:2] = torch.tensor([0, max_pos - 1])
    positions = positions.to(DEVICE)
    # Fused [T, heads + 1 + kv_heads + 1, D] buffer: q and k are strided views; the two sentinel
    # heads next to them must not change.
    fused = randn(gen, tokens, heads + kv_heads + 2, head_dim, dtype=dtype)
    sentinels = torch.stack([fused[:, heads], fused[:, -1]]).clone()
    q, k = fused[:, :heads], fused[:, heads + 1 : heads + 1 + kv_heads]
    expected_q, expected_k = rotary_f64(positions, q, cos_sin), rotary_f64(positions, k, cos_sin)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary_ref(positions, q_ref, k_ref, cos_sin)
    with force_triton():
        apply_rotary(positions, q, k, cos_sin)
    for got, ref, expected in ((q, q_ref, expected_q), (k, k_ref, expected_k)):
        assert rel_err(ref, expected) < tol(dtype)
        assert rel_err(got, ref) < tol(dtype)
        assert rel_err(got, expected) < tol(dtype)
    assert torch.equal(torch.stack([fused[:, heads], fused[:, -1]]), sentinels), "wrote outside q and k"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 1536])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = randn(gen, 5, 2 * d, dtype=dtype) * 4
    out = poisoned((5, d), dtype)
    with force_triton():
        got = silu_and_mul_triton(x, out=out)
        via_dispatch = silu_and_mul(x)
    assert got is out
    ref = silu_and_mul_ref(x)
    g, u = x[:, :d].double(), x[:, d:].double()
    expected = g * torch.sigmoid(g) * u
    assert rel_err(ref, expected) < tol(dtype)
    assert rel_err(out, ref) < tol(dtype)
    assert rel_err(out, expected) < tol(dtype)
    assert rel_err(via_dispatch, ref) < tol(dtype)
