"""Triton multi-LoRA shrink and expand: every token gathers its own adapter's weights by slot.

Same contract as :mod:`kernels.lora` (``lora_shrink_ref`` / ``lora_expand_ref``), without the host-side
grouping: the kernels read ``token_slots`` on the device, so a step needs no host sync and the same
launch serves decode batches (a different adapter per token) and prefill chunks (one adapter for
hundreds of consecutive tokens).

Work decomposition
------------------
Both kernels tile the tokens into ``BLOCK_M`` consecutive rows. Inside a tile a program walks the
*distinct* slots present in ascending order (``while`` over the smallest slot not yet done): for
each one it runs a dot over the rows that use it (the other rows are masked to zero and never
loaded) and keeps the result for those rows only. A prefill chunk's tile holds one slot, so it is
one tensor-core GEMM tile (SGMV); a decode tile holds up to ``BLOCK_M`` slots and degenerates to one
weight stream per slot (BGMV), still sharing each adapter among the tile's tokens that use it.
Tokens with slot ``-1`` are never part of a dot; tiles with no adapter at all cost one load.

* **shrink** ``h [T, R] = x [T, in] @ a[slot].T``: grid ``(token tiles, K splits)``. The output is
  only ``R <= 64`` wide and the reduction (``in``, thousands) is long, so a decode batch has too few
  tiles to fill the GPU: ``in`` is cut into ``split`` ranges, each program writes an fp32 partial
  ``[split, T, R]`` and ``torch.sum`` adds them (deterministic; no atomics, no zero-fill). With one
  split the kernel writes ``h`` directly. Rows whose slot is ``-1`` are written as zeros.
* **expand** ``y [T, out] += scales[slot] * h @ b[slot].T``: grid ``(token tiles, out tiles)``; the
  reduction is the rank (one ``BLOCK_R`` tile), so each program loads its ``h`` rows once, one
  ``[BLOCK_R, BLOCK_N]`` tile of ``b`` per slot, and reads-modifies-writes its ``y`` tile once.
  Rows with slot ``-1`` are neither read nor written. ``y`` may be any strided 2-D view (e.g. a
  column slice of a fused qkv output): both of its strides are honoured.

Precision: everything accumulates in fp32 and ``y`` is rounded once, on store (as the reference).
On a GPU, shrink with fp16/bf16 ``x`` and ``a`` of one dtype runs on tensor cores in that dtype
(products of two half values are exact in fp32); expand multiplies the fp32 ``h`` by ``b`` upcast to
fp32 with ``tf32x3`` (three TF32 MMAs, ~fp32 accuracy: rounding ``h`` to bf16 for a native dot would
add an error the reference does not have), and so do fp32 models in shrink. Under the interpreter
all dots run in fp32 ("ieee").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast_to, interpreting, next_pow2, num_programs_hint

_DONE = tl.constexpr(2**31 - 1)  # larger than any slot: marks rows whose slot is done (or -1)

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_SPLIT_MIN_K = 256  # a K split shorter than this costs more in launch and partials than it saves
_PROGRAMS_PER_SM = 2  # shrink splits K until about this many programs per SM are in flight
_PREFILL_TOKENS = 512  # from here on tiles of 64 tokens (prefill chunks share a slot per request)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slot_ptr,
    out_ptr,
    num_tokens,
    in_features,
    rank,
    k_per_split,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_os,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    row_ok = rows < num_tokens
    slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt

    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    pending = tl.where(slots >= 0, slots, _DONE)
    cur = tl.min(pending, axis=0)
    while cur < _DONE:
        sel = slots == cur
        a_cols = a_ptr + cur.to(tl.int64) * stride_as + r[None, :] * stride_ar  # a[cur].T: [K, R]
        part = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            xt = tl.load(x_rows + k[None, :] * stride_xk, mask=sel[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + k[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if NATIVE_DOT:
                part = tl.dot(xt, at, part)
            else:
                part = tl.dot(xt.to(tl.float32), at.to(tl.float32), part, input_precision=F32_DOT)
        acc = tl.where(sel[:, None], part, acc)
        pending = tl.where(sel, _DONE, pending)
        cur = tl.min(pending, axis=0)

    dst = out_ptr + split.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_ot + r[None, :]
    tl.store(dst, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    scale_ptr,
    slot_ptr,
    num_tokens,
    out_features,
    rank,
    stride_yt,
    stride_yn,
    stride_ht,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    F32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    n_ok = n < out_features
    slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    live = slots >= 0
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    rows64 = rows.to(tl.int64)

    h = tl.load(
        h_ptr + rows64[:, None] * stride_ht + r[None, :] * stride_hr,
        mask=live[:, None] & r_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pending = tl.where(live, slots, _DONE)
    cur = tl.min(pending, axis=0)
    while cur < _DONE:
        sel = slots == cur
        bt = tl.load(  # b[cur].T: [R, N]
            b_ptr + cur.to(tl.int64) * stride_bs + n[None, :] * stride_bn + r[:, None] * stride_br,
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        # All rows go through the dot (other slots' rows are finite, rows without an adapter are
        # zero); only the rows on this slot keep the result.
        delta = tl.dot(h, bt, input_precision=F32_DOT)
        acc = tl.where(sel[:, None], delta * tl.load(scale_ptr + cur).to(tl.float32), acc)
        pending = tl.where(sel, _DONE, pending)
        cur = tl.min(pending, axis=0)

    ok = live[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + rows64[:, None] * stride_yt + n[None, :] * stride_yn
    y = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, cast_to(y + acc, y_ptr.dtype.element_ty, INTERPRET), mask=ok)


def _gpu_tuned(t: torch.Tensor) -> bool:
    """Whether to pick GPU tile shapes and tensor-core dots (the compile check patches this)."""
    return t.is_cuda and not interpreting()


def _f32_dot(on_gpu: bool) -> str:
    """fp32 dots: three TF32 MMAs on a GPU (plain TF32 would miss fp32 accuracy), exact in numpy."""
    return "tf32x3" if on_gpu else "ieee"


def _block_r(rank: int) -> int:
    return max(_MIN_DOT, next_pow2(rank))


def _fresh(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An uninitialized fp32 buffer that the shrink kernel writes completely (tests fill it with NaN)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check_slots(token_slots: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if token_slots.shape != (num_tokens,):
        raise ValueError(f"token_slots must be [{num_tokens}], got {tuple(token_slots.shape)}")
    return token_slots if token_slots.stride(0) == 1 else token_slots.contiguous()


def choose_shrink_split(num_tiles: int, in_features: int, block_k: int, num_sms: int) -> int:
    """K splits for shrink: enough programs to fill the GPU, each at least ``_SPLIT_MIN_K`` long."""
    want = -(-_PROGRAMS_PER_SM * num_sms // max(num_tiles, 1))
    most = max(1, in_features // max(_SPLIT_MIN_K, block_k))
    return max(1, min(want, most))


def lora_shrink_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``x [T, in]``, ``a [slots, R, in]``, ``token_slots`` int ``[T]`` -> fp32 ``h [T, R]``.

    ``h[t] = x[t] @ a[slot[t]].T``; zeros where the slot is ``-1``. Slots must lie in
    ``[-1, slots)`` (not checked: that would need a host sync). ``block_m``/``block_k``/``split_k``
    override the launch configuration (tests use them to reach tiling edge cases, the benchmark to
    compare). Any strides are accepted; a unit stride along ``in`` is what makes loads wide.
    """
    num_tokens, in_features = x.shape
    _, rank, a_in = a.shape
    if a_in != in_features:
        raise ValueError(f"x has {in_features} features but the adapters take {a_in}")
    slots = _check_slots(token_slots, num_tokens)
    if num_tokens == 0 or rank == 0 or in_features == 0:
        return torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)

    on_gpu = _gpu_tuned(x)
    native = on_gpu and x.dtype == a.dtype and x.dtype in (torch.float16, torch.bfloat16)
    bm = block_m or (64 if on_gpu and num_tokens >= _PREFILL_TOKENS else 16)
    bk = block_k or ((128 if native else 64) if on_gpu else 32)
    if bm < _MIN_DOT or bk < _MIN_DOT:
        raise ValueError(f"tile {bm}x{bk} too small (dots need >= {_MIN_DOT})")
    num_tiles = triton.cdiv(num_tokens, bm)
    split = split_k or choose_shrink_split(num_tiles, in_features, bk, num_programs_hint(x.device))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), bk) * bk
    split = triton.cdiv(in_features, k_per_split)  # no empty split

    out = _fresh((split, num_tokens, rank), x.device)
    _lora_shrink_kernel[(num_tiles, split)](
        x,
        a,
        slots,
        out,
        num_tokens,
        in_features,
        rank,
        k_per_split,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_K=bk,
        BLOCK_R=_block_r(rank),
        NATIVE_DOT=native,
        F32_DOT=_f32_dot(on_gpu),
        num_warps=num_warps,
        num_stages=3 if on_gpu else 1,
    )
    return out[0] if split == 1 else out.sum(dim=0)


def _expand_block_n(num_tiles: int, out_features: int, block_m: int, num_sms: int) -> int:
    """Widest output tile (128 for prefill tiles, 64 for decode) that still gives every SM a program."""
    bn = 128 if block_m >= 64 else 64
    while bn > 32 and num_tiles * triton.cdiv(out_features, bn) < num_sms:
        bn //= 2
    return bn


def lora_expand_triton(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``y [T, out] += scales[slot] * h @ b[slot].T`` in place for tokens with a slot; returns ``y``.

    ``h [T, R]`` (fp32, as shrink makes it), ``b [slots, out, R]``, ``scales [slots]``. ``y`` may be
    fp32/fp16/bf16 and any strided 2-D view (a column slice of a fused projection is the intended
    case); it is rounded once, after the fp32 add. Rows whose slot is ``-1`` are not touched.
    """
    num_tokens, out_features = y.shape
    num_slots, b_out, rank = b.shape
    if b_out != out_features:
        raise ValueError(f"y has {out_features} columns but the adapters produce {b_out}")
    if h.shape != (num_tokens, rank):
        raise ValueError(f"h must be [{num_tokens}, {rank}], got {tuple(h.shape)}")
    if scales.shape != (num_slots,):
        raise ValueError(f"scales must be [{num_slots}], got {tuple(scales.shape)}")
    slots = _check_slots(token_slots, num_tokens)
    if num_tokens == 0 or out_features == 0 or rank == 0:
        return y
    scales = scales if scales.stride(0) == 1 else scales.contiguous()

    on_gpu = _gpu_tuned(y)
    bm = block_m or (64 if on_gpu and num_tokens >= _PREFILL_TOKENS else 16)
    num_tiles = triton.cdiv(num_tokens, bm)
    if block_n is None:
        block_n = _expand_block_n(num_tiles, out_features, bm, num_programs_hint(y.device)) if on_gpu else 32
    if bm < _MIN_DOT or block_n < _MIN_DOT:
        raise ValueError(f"tile {bm}x{block_n} too small (dots need >= {_MIN_DOT})")
    _lora_expand_kernel[(num_tiles, triton.cdiv(out_features, block_n))](
        y,
        h,
        b,
        scales,
        slots,
        num_tokens,
        out_features,
        rank,
        y.stride(0),
        y.stride(1),
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_R=_block_r(rank),
        F32_DOT=_f32_dot(on_gpu),
        INTERPRET=interpreting(),
        num_warps=num_warps,
        num_stages=2 if on_gpu else 1,
    )
    return y
