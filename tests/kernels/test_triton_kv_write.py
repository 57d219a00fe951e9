"""KV write by slot mapping: Triton kernel vs torch reference vs a float64 scatter done by hand.

Caches start as NaN so that the test sees exactly which slots were written; keys and values come
as strided views of a fused QKV buffer; slots are scattered over shuffled blocks, with -1 entries.
"""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import DEVICE, DTYPES, rel_err, tol

from kernels import force_triton, write_kv
from kernels.kv_write import write_kv_ref
from kernels.triton_kv_write import write_kv_triton


def make_inputs(seed: int, num_tokens: int, block_size: int, kv_heads: int, head_dim: int, skip: int):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    # Fused [T, q + k + v heads, D] buffer in fp32; k and v are non-contiguous views of it.
    fused = torch.randn(num_tokens, 2 + 2 * kv_heads, head_dim, generator=gen).to(DEVICE)
    key, value = fused[:, 2 : 2 + kv_heads], fused[:, 2 + kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:skip]] = -1
    return key, value, slots.to(DEVICE), (num_blocks, block_size, kv_heads, head_dim)


def write_f64(key: torch.Tensor, value: torch.Tensor, shape, slots: torch.Tensor):
    k = torch.full(shape, float("nan"), dtype=torch.float64).view(-1, *shape[2:])
    v = k.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k[s], v[s] = key[t].double().cpu(), value[t].double().cpu()
    return k.view(shape), v.view(shape)


def assert_cache_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    written = ~torch.isnan(expected.cpu())
    assert torch.equal(written, ~torch.isnan(actual.cpu())), "wrong set of slots written"
    assert rel_err(actual.cpu()[written], expected.cpu()[written]) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kv_matches_reference(block_size: int, dtype: torch.dtype) -> None:
    key, value, slots, shape = make_inputs(block_size, 37, block_size, 3, 24, skip=5)
    caches = {}
    for name, fn in (("ref", write_kv_ref), ("triton", write_kv_triton)):
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        with force_triton():
            fn(key, value, k_cache, v_cache, slots)
        caches[name] = (k_cache, v_cache)
    k64, v64 = write_f64(key, value, shape, slots)
    for k_cache, v_cache in caches.values():
        assert_cache_matches(k_cache, k64, dtype)
        assert_cache_matches(v_cache, v64, dtype)
    # Same rounding as torch's cast, so the two paths store identical bits.
    for a, b in zip(caches["ref"], caches["triton"], strict=True):
        assert torch.equal(a.cpu().nan_to_num(7.0), b.cpu().nan_to_num(7.0))


def test_write_kv_dispatch_and_all_skipped() -> None:
    key, value, slots, shape = make_inputs(5, 9, 16, 2, 32, skip=0)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    with force_triton():
        write_kv(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()
    with force_triton():
        write_kv(key, value, k_cache, v_cache, slots.int())  # int32 slots, as the engine may pass
    k64, v64 = write_f64(key, value, shape, slots)
    assert_cache_matches(k_cache, k64, torch.float32)
    assert_cache_matches(v_cache, v64, torch.float32)
