"""The compiled CPU KV write (kernels/csrc/kv_write_cpu.cpp) against the torch reference: caches start
as NaN so the exact set of written slots shows; keys and values are strided views of a fused QKV
buffer; slots are shuffled over the blocks, with -1 entries skipped."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_kernels import cpu_kernels
from kernels.kv_write import write_kv, write_kv_ref


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    assert cpu_kernels() is not None, "the CPU kernels did not build on this machine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "skip"), [(1, 0), (19, 4), (40, 40)])
def test_writes_the_same_bits_as_the_reference(dtype: torch.dtype, tokens: int, skip: int) -> None:
    g = torch.Generator().manual_seed(tokens * 10 + skip)
    kv_heads, head_dim, block_size = 3, 32, 8
    num_blocks = -(-tokens // block_size) + 2
    fused = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    key = fused[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = fused[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    assert tokens == 1 or not key.is_contiguous()  # one row is contiguous whatever its stride
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.randperm(tokens, generator=g)[:skip]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = {}
    for name, fn in (("compiled", write_kv), ("ref", write_kv_ref)):
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
        fn(key, value, k_cache, v_cache, slots.int() if name == "compiled" else slots)
        caches[name] = (k_cache, v_cache)
    for got, want in zip(caches["compiled"], caches["ref"], strict=True):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    written = int((~torch.isnan(caches["compiled"][0].float())).sum())
    assert written == (tokens - skip) * kv_heads * head_dim


def test_refuses_a_slot_outside_the_cache_and_mixed_dtypes() -> None:
    module = cpu_kernels()
    assert module is not None
    key = value = torch.randn(2, 1, 16)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.write_kv(key, value, k_cache, v_cache, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        module.write_kv(key, value, k_cache.bfloat16(), v_cache.bfloat16(), torch.tensor([0, 1]))
    # the dispatcher keeps the reference for mixed dtypes (it casts to the cache's)
    write_kv(key, value, k_cache.bfloat16(), v_cache.bfloat16(), torch.tensor([0, 1]))
