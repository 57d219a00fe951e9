"""Unified paged attention: Triton kernel vs torch reference vs an independent float64 computation.

Every batch is built so that mistakes show: block tables are shuffled (non-contiguous, any order),
block 0 is a NaN "null" block that padded table entries point to, every unowned block and every
slot past a sequence's length is NaN, and the output is NaN before the launch. A wrong mask, block
index or row mapping therefore yields NaN or a large error rather than a lucky match.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from triton_test_utils import DEVICE, poisoned, rel_err, tol

from kernels import PagedAttentionMetadata, force_triton, paged_attention
from kernels.attention_ref import paged_attention_ref
from kernels.triton_attention import choose_num_kv_splits, paged_attention_triton


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    q_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    scale: float


def make_batch(
    seed: int,
    q_lens: list[int],
    ctx_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3  # block 0 (null) plus two never-owned blocks
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(order[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen)
    v_cache = torch.randn(*shape, generator=gen)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for table, n in zip(tables, seq_lens, strict=True):
        for p in range(n):
            owned[table[p // block_size] * block_size + p % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    return Batch(
        q=q.to(dtype).to(DEVICE),
        k_cache=k_cache.to(dtype).to(DEVICE),
        v_cache=v_cache.to(dtype).to(DEVICE),
        meta=PagedAttentionMetadata.build(q_lens, seq_lens, tables, device=DEVICE),
        q_lens=q_lens,
        seq_lens=seq_lens,
        tables=tables,
        scale=head_dim**-0.5,
    )


def attention_f64(b: Batch) -> torch.Tensor:
    """Textbook causal softmax attention in float64, one sequence at a time, keys gathered by position."""
    q = b.q.double().cpu()
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = b.k_cache.shape[1], b.k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_flat = b.k_cache.double().cpu().reshape(-1, num_kv_heads, head_dim)
    v_flat = b.v_cache.double().cpu().reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(q)
    row = 0
    for q_len, seq_len, table in zip(b.q_lens, b.seq_lens, b.tables, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        qs = q[row : row + q_len]  # [q_len, H, D]
        scores = torch.einsum("thd,lhd->htl", qs, k) * b.scale
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
        out[row : row + q_len] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
        row += q_len
    return out


def run_both(b: Batch, **triton_kwargs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and Triton outputs, each written into a NaN-poisoned buffer."""
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=poisoned(b.q.shape, b.q.dtype))
    out = poisoned(b.q.shape, b.q.dtype)
    with force_triton():
        if triton_kwargs:
            tri = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out, **triton_kwargs)
        else:
            tri = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, b.scale, out=out)
    assert tri.data_ptr() == out.data_ptr()
    return ref, tri


def check(b: Batch, **triton_kwargs: int) -> torch.Tensor:
    ref, tri = run_both(b, **triton_kwargs)
    expected = attention_f64(b)
    t = tol(b.q.dtype)
    assert rel_err(ref, expected) < t, "reference disagrees with float64"
    assert rel_err(tri, ref) < t, "Triton disagrees with the reference"
    assert rel_err(tri, expected) < t, "Triton disagrees with float64"
    return tri


def mixed_lens(bs: int) -> tuple[list[int], list[int]]:
    """(q_lens, ctx_lens): length-1, block-boundary, cached context + chunk, prefills, decodes."""
    cases = [
        (1, 0),  # a one-token sequence
        (1, bs - 1),  # decode whose sequence exactly fills one block
        (1, bs),  # decode that opens a new block
        (bs, 0),  # prefill of exactly one block
        (7, 2 * bs - 3),  # chunk over cached context, crossing a block boundary
        (2 * bs + 3, 0),  # ragged prefill over three blocks
        (1, 3 * bs + 5),  # longer decode
        (bs + 1, bs),  # chunk starting on a block boundary
    ]
    return [c[0] for c in cases], [c[1] for c in cases]


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_fp32(block_size: int, group: int) -> None:
    q_lens, ctx = mixed_lens(block_size)
    b = make_batch(100 + block_size + group, q_lens, ctx, block_size, 2, group, 32, torch.float32)
    check(b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_mixed_batch_half(dtype: torch.dtype, group: int) -> None:
    q_lens, ctx = mixed_lens(16)
    check(make_batch(7 + group, q_lens, ctx, 16, 2, group, 64, dtype))


def test_odd_head_dim_and_single_kv_head() -> None:
    """head_dim 24 is padded to a 32-wide tile; one KV head means every query head shares it."""
    q_lens, ctx = mixed_lens(8)
    check(make_batch(3, q_lens, ctx, 8, 1, 3, 24, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_only_batch(dtype: torch.dtype, group: int) -> None:
    lens = [1, 15, 16, 17, 40]
    b = make_batch(11 + group, [1] * len(lens), [n - 1 for n in lens], 16, 2, group, 32, dtype)
    check(b, num_splits=1)


def test_decode_batch_with_idle_sequence() -> None:
    """One token per tile, but not one per sequence: the tile -> sequence search must skip q_len 0."""
    b = make_batch(17, [1, 0, 1, 1], [5, 9, 20, 16], 8, 2, 3, 32, torch.float32)
    check(b, num_splits=1)
    check(b, num_splits=2)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_split_kv_decode_matches_single_pass(num_splits: int) -> None:
    lens = [1, 9, 33, 70, 129]  # shorter than, about, and much longer than num_splits tiles
    b = make_batch(21 + num_splits, [1] * len(lens), [n - 1 for n in lens], 8, 2, 3, 32, torch.float32)
    single = check(b, num_splits=1)
    split = check(b, num_splits=num_splits)
    assert rel_err(split, single) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_kv_decode_half(dtype: torch.dtype) -> None:
    lens = [5, 48, 100]
    b = make_batch(31, [1] * len(lens), [n - 1 for n in lens], 16, 2, 8, 32, dtype)
    check(b, num_splits=4)


def test_split_kv_mixed_batch_with_empty_sequence() -> None:
    """Split-KV on prefill rows too: early rows see no key in late splits (lse -inf); q_len 0 is skipped."""
    q_lens, ctx = [5, 0, 1, 20], [3, 4, 30, 9]
    b = make_batch(41, q_lens, ctx, 8, 2, 3, 32, torch.float32)
    single = check(b, num_splits=1)
    split = check(b, num_splits=3)
    assert rel_err(split, single) < 1e-5


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (64, 64), (32, 32)])
def test_tile_shapes(block_m: int, block_n: int) -> None:
    """Key tiles smaller and larger than a cache block; query tiles of 5 to 21 tokens (group 3)."""
    q_lens, ctx = mixed_lens(16)
    b = make_batch(51 + block_m + block_n, q_lens, ctx, 16, 2, 3, 32, torch.float32)
    check(b, block_m=block_m, block_n=block_n, num_splits=1)


def test_strided_query_and_meta_override() -> None:
    """q as a view into a fused QKV buffer; ``meta.kv_splits`` pins the split count."""
    q_lens, ctx = [3, 1, 1], [0, 20, 7]
    b = make_batch(61, q_lens, ctx, 8, 2, 3, 32, torch.float32)
    fused = torch.cat([b.q, torch.full_like(b.q, float("nan"))], dim=1)
    b.q = fused[:, : b.q.shape[1]]
    assert not b.q.is_contiguous()
    check(b)
    b.meta.kv_splits = 3
    check(b)


def test_choose_num_kv_splits() -> None:
    sms = 132
    assert choose_num_kv_splits(4, 8, 16, 8192, sms) == 1  # prefill in the batch: no split
    assert choose_num_kv_splits(512, 8, 1, 8192, sms) == 1  # enough programs already
    assert choose_num_kv_splits(1, 8, 1, 100, sms) == 1  # too short to split
    few = choose_num_kv_splits(1, 8, 1, 8192, sms)
    assert 8 <= few <= 32
    assert choose_num_kv_splits(32, 8, 1, 2048, sms) <= few
    assert choose_num_kv_splits(2, 3, 1, 512, sms) == 2  # capped by context / minimum split length
