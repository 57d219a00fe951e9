"""Triton unified paged attention: prefill chunks and decode tokens of a flat batch in one launch.

Work decomposition
------------------
Grid ``(query tiles, kv heads, kv splits)``. A query tile is up to ``BLOCK_Q`` consecutive new
tokens of *one* sequence times the ``GROUP`` query heads that share a KV head (GQA), flattened into
``BLOCK_M`` rows (``BLOCK_Q = BLOCK_M // GROUP``; leftover rows idle), so every K/V tile is loaded
once for the whole group and GQA ratios that are not powers of two (3) waste at most a few rows.
Tiles are numbered per sequence without a host sync: sequence ``s`` owns tiles starting at
``query_start_loc[s] // BLOCK_Q + s`` (an upper bound that leaves at most one idle tile per
sequence); each program finds its sequence by binary search over ``query_start_loc``. Decode-only
batches use ``BLOCK_Q = 1`` and one tile per token (no idle tiles); when every sequence has exactly
one token (the usual decode step) tile ``t`` is sequence ``t`` and the search is skipped.

Each program walks its keys in ``BLOCK_N``-token tiles. The physical address of key position
``p`` is ``block_tables[s, p // block_size] * block_size + p % block_size``, gathered per key, so
``BLOCK_N`` is independent of the cache block size (8, 16, 32, ...) and block tables may be in any
order. Scores use an online softmax in the exp2 domain with fp32 running max, sum and accumulator;
keys after a query's position (causal inside the new chunk) or past the sequence are masked, and
their loads are masked too, so stale or NaN cache slots never leak in.

Split-KV
--------
With ``num_splits > 1`` the keys visible to a tile are cut into ``num_splits`` equal ranges (per
sequence, rounded up to ``BLOCK_N``); each program writes a normalized partial output and its
log-sum-exp (base 2; ``-inf`` for rows that saw no key), and a second kernel merges the splits per
(token, head). The split count is a runtime argument, so a new count does not compile anew.
This feeds the GPU when a decode batch has too few (sequence, kv head) pairs to fill it;
:func:`choose_num_kv_splits` (below) decides.

Precision: under the interpreter (and for fp32 caches) the dots run in fp32 (IEEE, not TF32); on
a GPU with fp16/bf16 caches they run on tensor cores in the cache dtype with fp32 accumulation,
the probabilities rounded to the cache dtype for the P@V product (as flash attention does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention_metadata import PagedAttentionMetadata
from kernels.triton_common import cast_to, interpreting, next_pow2, num_programs_hint

_NEG_BIG = tl.constexpr(-1.0e30)  # running-max seed: finite, so fully masked tiles never compute inf - inf


@triton.jit
def _find_sequence(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest ``s`` whose first tile index is <= ``tile`` (see the module docstring)."""
    lo = tile * 0  # int32 tensors from the start: a loop-carried value must keep its type
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) if BLOCK_Q == 1 else tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ONE_TOKEN_PER_SEQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq = tile_id if ONE_TOKEN_PER_SEQ else _find_sequence(qsl_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    first_tile = q_start if BLOCK_Q == 1 else q_start // BLOCK_Q + seq
    tile_q0 = (tile_id - first_tile) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok = tile_q0 + rows // GROUP  # token index inside the sequence's new chunk
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # absolute position of the row's token

    # Keys this tile may see: up to its last token's position; nothing for an idle tile.
    kv_limit = tl.where(tile_q0 < q_len, tl.minimum(seq_len, ctx_len + tile_q0 + BLOCK_Q), 0)
    if SPLIT_KV:
        split_len = tl.cdiv(tl.cdiv(kv_limit, num_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, kv_limit)
    else:
        lo = 0
        hi = kv_limit

    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch

    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_ok = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
        k_t = tl.load(
            k_cache_ptr + kv_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0
        )
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, k_t) if NATIVE_DOT else tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
        visible = n_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if NATIVE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    store_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT_KV:
        # Partials are contiguous [num_tokens, num_heads, num_splits, HEAD_DIM] fp32.
        lse_idx = (q_rows * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + lse_idx[:, None] * HEAD_DIM + d[None, :], o, mask=store_ok)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + lse_idx, lse, mask=row_ok)
    else:
        dst = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, cast_to(o, out_ptr.dtype.element_ty, INTERPRET), mask=store_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * num_splits
    sp = tl.arange(0, SPLITS_P)
    sp_ok = sp < num_splits
    lse = tl.load(part_lse_ptr + base + sp, mask=sp_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always saw key 0, so the max is finite
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_DIM
    parts = tl.load(
        part_out_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :],
        mask=sp_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    parts = tl.where((w > 0.0)[:, None], parts, 0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        cast_to(o, out_ptr.dtype.element_ty, INTERPRET),
        mask=d_ok,
    )


# Split-KV heuristic. A decode program streams one sequence's keys for one KV head; with fewer such
# programs than the GPU holds in flight, bandwidth sits idle, so long contexts are cut into splits
# (merged afterwards). Mixed/prefill batches have query tiles enough.
_SPLIT_TARGET_PROGRAMS_PER_SM = 8  # resident 4-warp programs per SM needed to saturate HBM
_SPLIT_MIN_KEYS = 256  # below this a split costs more in launch/merge than it saves
_SPLIT_MAX = 32


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """Number of KV splits for a batch: 1 (single pass) unless a decode batch underfills the GPU."""
    if max_query_len != 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    want = -(-(_SPLIT_TARGET_PROGRAMS_PER_SM * num_sms) // programs)
    return max(1, min(want, max_seq_len // _SPLIT_MIN_KEYS, _SPLIT_MAX))


def _gpu_tuned(q: torch.Tensor) -> bool:
    """Whether to pick GPU tile shapes and tensor-core dots (the compile check patches this)."""
    return q.is_cuda and not interpreting()


def _tile_config(max_query_len: int, group: int, head_dim: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a batch; decode-only batches get one token per tile.

    Decode is a stream over K/V: small row tiles (the GQA group padded to the 16 rows a dot needs)
    and several stages of 64-key tiles in flight. Prefill is compute-bound: 64/128-row tiles. Off
    the GPU (interpreter) small tiles keep the per-op cost low and exercise more loop iterations.
    """
    rows_min = max(16, next_pow2(group))
    if max_query_len <= 1:
        if not on_gpu:
            return rows_min, 16, 4, 1
        return rows_min, 64, 4, 3 if head_dim <= 64 else 2
    if not on_gpu:
        return max(32, rows_min), 16, 4, 1
    block_m = max(128 if max_query_len * group >= 128 else 64, rows_min)
    return block_m, 64, 8 if block_m >= 128 else 4, 2


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.attention.paged_attention`.

    ``num_splits`` (else ``meta.kv_splits``, else the heuristic) picks single-pass (1) or split-KV;
    ``block_m``/``block_n``/``num_warps``/``num_stages`` override the launch configuration (tests
    use them to cover tiling edge cases, the benchmark to sweep configurations).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share one layout with a contiguous head_dim")
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous head_dim")
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    on_gpu = _gpu_tuned(q)
    bm, bn, warps, stages = _tile_config(meta.max_query_len, group, head_dim, on_gpu)
    bm, bn = block_m or bm, block_n or bn
    warps, stages = num_warps or warps, num_stages or stages
    block_q = 1 if meta.max_query_len <= 1 else bm // group
    if bm < max(group, 16) or bn < 16:
        raise ValueError(f"tile {bm}x{bn} too small for {group} heads per kv head (dots need >= 16)")
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs

    if num_splits is None:
        num_splits = meta.kv_splits
    if num_splits is None:
        num_splits = choose_num_kv_splits(
            num_seqs, num_kv_heads, meta.max_query_len, meta.max_seq_len, num_programs_hint(q.device)
        )
    num_splits = max(int(num_splits), 1)

    native = on_gpu and q.dtype == k_cache.dtype and q.dtype in (torch.float16, torch.bfloat16)
    interp = interpreting()
    if num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # never touched by the single-pass specialization
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        num_seqs,
        float(scale) * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        HEAD_P=next_pow2(head_dim),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=bm,
        BLOCK_Q=block_q,
        ONE_TOKEN_PER_SEQ=block_q == 1 and num_tokens == num_seqs,
        BLOCK_N=bn,
        SPLIT_KV=num_splits > 1,
        NATIVE_DOT=native,
        INTERPRET=interp,
        num_warps=warps,
        num_stages=stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_P=next_pow2(head_dim),
            SPLITS_P=next_pow2(num_splits),
            INTERPRET=interp,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
