"""The compiled CPU attention kernel (kernels/csrc) vs the torch reference vs float64.

``paged_attention`` on CPU tensors sends every query row to the compiled kernel, decodes and the
rows of prefill chunks alike (causal: each row over its prefix of keys); these batches (shuffled
block tables, NaN in every slot a sequence does not own, NaN output buffers) fail on a wrong block,
slot, head, row or prefix length.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_attention import attention_f64, make_batch, mixed_lens
from triton_test_utils import rel_err, tol

from kernels import attention_ref
from kernels.attention import paged_attention
from kernels.attention_ref import paged_attention_ref
from kernels.cpu_kernels import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    assert cpu_kernels() is not None, "the CPU kernels did not build on this machine"


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decodes_match_float64(block_size: int, group: int) -> None:
    ctx = [0, block_size - 1, block_size, 3 * block_size + 5, 1, 2 * block_size - 1]
    b = make_batch(block_size * 10 + group, [1] * len(ctx), ctx, block_size, 2, group, 64, torch.float32)
    out = torch.full(b.q.shape, float("nan"))
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(got, attention_f64(b)) < 1e-5
    assert rel_err(got, paged_attention_ref(b.q, b.k_cache, b.v_cache, b.meta, b.scale)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype: torch.dtype) -> None:
    b = make_batch(7, [1] * 5, [3, 17, 40, 1, 64], 16, 3, 3, 64, torch.float32)
    b.k_cache, b.v_cache = b.k_cache.to(dtype), b.v_cache.to(dtype)
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale)
    assert rel_err(got, attention_f64(b)) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_reads_and_writes_its_own_dtype(dtype: torch.dtype) -> None:
    """A bf16/fp16 model's q over its cache: the kernel takes q and writes the output in that dtype
    (no fp32 copies around it), decodes and prefill chunks of one batch alike."""
    q_lens, ctx = mixed_lens(16)
    b = make_batch(23, q_lens, ctx, 16, 3, 3, 64, torch.float32)
    b.q, b.k_cache, b.v_cache = b.q.to(dtype), b.k_cache.to(dtype), b.v_cache.to(dtype)
    out = torch.full(b.q.shape, float("nan"), dtype=dtype)
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert got.dtype == dtype and got.data_ptr() == out.data_ptr()
    assert rel_err(got, attention_f64(b)) < tol(dtype)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [32, 64])  # the generic loop, the register-blocked one
def test_mixed_batch_decodes_and_chunks_in_the_kernel(
    block_size: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_sdpa(*args: object, **kwargs: object) -> None:
        raise AssertionError("a chunk went through the reference's SDPA")

    monkeypatch.setattr(attention_ref.F, "scaled_dot_product_attention", no_sdpa)
    q_lens, ctx = mixed_lens(block_size)
    b = make_batch(block_size, q_lens, ctx, block_size, 2, 3, head_dim, torch.float32)
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=torch.full(b.q.shape, float("nan")))
    assert rel_err(got, attention_f64(b)) < 1e-5


@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (5, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_after_cached_context(group: int, head_dim: int, cache_dtype: torch.dtype) -> None:
    """Rows of one chunk attend to ever longer prefixes (the kernel deals them out first, last,
    second, ...), beside a decode; register-blocked (group 3) and generic (group 5) loops."""
    b = make_batch(group + head_dim, [150, 1, 37], [90, 200, 0], 16, 2, group, head_dim, torch.float32)
    b.k_cache, b.v_cache = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=torch.full(b.q.shape, float("nan")))
    assert rel_err(got, attention_f64(b)) < (1e-5 if cache_dtype == torch.float32 else tol(cache_dtype))


@pytest.mark.parametrize(("group", "head_dim"), [(4, 128), (2, 128), (5, 64), (6, 128)])
def test_register_blocked_and_generic_shapes(group: int, head_dim: int) -> None:
    """Head dims 64 and 128 with 1-4 or 8 query heads per KV head take the register-blocked loop;
    other groups (5, 6) the generic one; both in fp32 and over a bf16 cache."""
    b = make_batch(group * head_dim, [1] * 4, [1, 15, 16, 70], 16, 2, group, head_dim, torch.float32)
    out = torch.full(b.q.shape, float("nan"))
    assert (
        rel_err(paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out), attention_f64(b)) < 1e-5
    )
    b.k_cache, b.v_cache = b.k_cache.bfloat16(), b.v_cache.bfloat16()
    assert rel_err(paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale), attention_f64(b)) < tol(
        torch.bfloat16
    )


def test_odd_head_dim_takes_the_scalar_path() -> None:
    b = make_batch(3, [1, 1, 1], [5, 20, 33], 8, 1, 4, 24, torch.float32)
    assert rel_err(paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale), attention_f64(b)) < 1e-5


def test_strided_query_view() -> None:
    b = make_batch(11, [1, 1], [9, 30], 8, 2, 2, 64, torch.float32)
    wide = torch.cat([b.q, torch.randn_like(b.q)], dim=-1)[..., :64]  # non-contiguous, like a QKV slice
    assert not wide.is_contiguous()
    assert rel_err(paged_attention(wide, b.k_cache, b.v_cache, b.meta, b.scale), attention_f64(b)) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_with_more_kv_heads_than_one_pass_holds(cache_dtype: torch.dtype) -> None:
    """A decode batch with rows to spare per thread is dealt out whole rows at a time (every KV head);
    10 KV heads take two passes over the keys (8 heads' queries at a time) in the AVX2 build."""
    b = make_batch(41, [1] * 6, [1, 16, 17, 40, 3, 64], 16, 10, 2, 64, torch.float32)
    b.k_cache, b.v_cache = b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    got = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=torch.full(b.q.shape, float("nan")))
    assert rel_err(got, attention_f64(b)) < (1e-5 if cache_dtype == torch.float32 else tol(cache_dtype))
