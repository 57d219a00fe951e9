"""Loom kernel benchmark: check every Triton kernel against its torch reference, then time it.

Three modes:

* default (needs CUDA): for SmolLM2-135M and a Llama-3-8B-like shape, check each kernel against
  its reference on the GPU, time it with ``triton.testing.do_bench`` (median), and report achieved
  memory bandwidth against a measured device-to-device copy. Decode attention is timed single-pass
  and split-KV; prefill attention also against ``torch.nn.functional.scaled_dot_product_attention``.
  Multi-LoRA shrink/expand are timed at decode batches (one adapter per token, mixed) and a prefill
  chunk (one adapter), against the torch reference (grouped GEMMs) as the eager baseline.
  Writes ``results.json`` and ``results.md`` into ``--out`` and prints a short Markdown table last.
* ``--dry-run``: the same code path on tiny shapes through the Triton interpreter on CPU (timings
  are meaningless); shows that the script runs before a GPU is spent on it.
* ``--compile-only``: compiles every kernel variant the default mode launches for ``sm_90``
  (H100/H200) without a GPU, which catches code-generation errors the interpreter lets through.

Run: ``python -m kernels.bench.run [--out DIR]`` from the repository root (see README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


MODELS = [
    ModelShape("smollm2-135m", 9, 3, 64, 576, 1536),
    ModelShape("llama3-8b", 32, 8, 128, 4096, 14336),
]
TINY = ModelShape("tiny", 6, 2, 32, 64, 96)


@dataclass(frozen=True)
class Plan:
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    mixed: tuple[int, int, int]  # (prefill chunk, decodes, decode context)
    elementwise_tokens: tuple[int, ...]
    max_context: int
    check_cap_tokens: int  # check attention against the reference up to batch * context tokens
    lora_decode: tuple[int, ...] = ()  # decode batches for LoRA (tokens on mixed adapters)
    lora_prefill: int = 0  # one prefill chunk on one adapter (0: none)
    lora_ranks: tuple[int, ...] = ()


FULL = Plan((1, 8, 32, 64, 128, 256), (512, 2048, 8192), (512, 1024, 2048, 4096), (2048, 64, 2048),
            (256, 4096), 8192, 1 << 20, (1, 16, 64, 256), 2048, (16, 64))  # fmt: skip
DRY = Plan((1, 3), (40,), (24,), (8, 2, 20), (5,), 64, 1 << 20, (1, 5), 20, (4, 16))
LORA_SLOTS = 16  # adapters loaded per replica


@dataclass
class Row:
    kernel: str
    model: str
    shape: str
    variant: str
    ms: float
    bytes: int
    gbs: float = 0.0
    pct_copy: float = 0.0
    tflops: float | None = None
    baseline_ms: float | None = None  # torch reference (elementwise) or SDPA (prefill)
    err: float | None = None
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


class Bench:
    """Holds the device, the timer, the copy baseline and the collected rows."""

    def __init__(self, device: str, dtype: torch.dtype, block_size: int, budget_s: float) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.deadline = time.monotonic() + budget_s
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.skipped = 0
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.copy_gbs = 0.0
        self.tol = 1e-5 if dtype == torch.float32 else 1e-2

    @property
    def elem(self) -> int:
        """Bytes per element of the benchmark dtype."""
        return torch.finfo(self.dtype).bits // 8

    # -- timing ---------------------------------------------------------------------------
    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        fn()  # interpreter: one warm call, one timed call (the number only proves the plumbing)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def out_of_time(self) -> bool:
        if time.monotonic() > self.deadline:
            self.skipped += 1
            return True
        return False

    def measure_copy(self) -> None:
        n = (1 << 30) if self.device == "cuda" else (1 << 24)
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        ms = self.time_ms(partial(dst.copy_, src))
        self.copy_gbs = 2 * n / ms / 1e6
        print(
            f"device-to-device copy: {self.copy_gbs:,.0f} GB/s ({2 * n / 2**30:.0f} GiB moved in {ms:.3f} ms)"
        )

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype or self.dtype)

    # -- reporting ------------------------------------------------------------------------
    def add(self, row: Row) -> Row:
        row.gbs = row.bytes / row.ms / 1e6
        row.pct_copy = 100.0 * row.gbs / self.copy_gbs if self.copy_gbs else 0.0
        if row.err is not None:
            row.ok = row.err < self.tol
            if not row.ok:
                self.failures.append(f"{row.kernel} {row.model} {row.shape} {row.variant}: err {row.err:.2e}")
        self.rows.append(row)
        check = "" if row.err is None else f" err {row.err:.1e} {'ok' if row.ok else 'FAIL'}"
        flops = "" if row.tflops is None else f" {row.tflops:6.1f} TFLOP/s"
        base = "" if row.baseline_ms is None else f" (baseline {row.baseline_ms:.3f} ms)"
        print(
            f"{row.kernel:<16} {row.model:<13} {row.shape:<26} {row.variant:<10} {row.ms:9.3f} ms "
            f"{row.gbs:8.0f} GB/s {row.pct_copy:5.1f}% copy{flops}{base}{check}",
            flush=True,
        )
        return row


# -- attention --------------------------------------------------------------------------------


def make_paged_batch(b: Bench, m: ModelShape, q_lens: list[int], seq_lens: list[int]):
    """Q, caches and metadata for a batch whose block tables are a random permutation of the cache."""
    from kernels.attention_metadata import PagedAttentionMetadata

    bs = b.block_size
    need = [-(-n // bs) for n in seq_lens]
    order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(order[i : i + n])
        i += n
    shape = (sum(need), bs, m.kv_heads, m.head_dim)
    k_cache, v_cache = b.randn(*shape), b.randn(*shape)
    q = b.randn(sum(q_lens), m.heads, m.head_dim)
    meta = PagedAttentionMetadata.build(q_lens, seq_lens, tables, device=b.device)
    return q, k_cache, v_cache, meta


def attention_bytes(m: ModelShape, q_lens: list[int], seq_lens: list[int], elem: int) -> int:
    kv = sum(seq_lens) * m.kv_heads * m.head_dim * 2 * elem
    return kv + 2 * sum(q_lens) * m.heads * m.head_dim * elem


def attention_flops(m: ModelShape, q_lens: list[int], seq_lens: list[int]) -> float:
    """Two matmuls over the causally visible keys of every query."""
    visible = sum(sum(n - q + 1 + t for t in range(q)) for q, n in zip(q_lens, seq_lens, strict=True))
    return 4.0 * visible * m.heads * m.head_dim


def bench_decode(b: Bench, m: ModelShape, plan: Plan, sms: int) -> None:
    """Decode batches single-pass and split-KV (the heuristic's count, or 4 where it picks 1)."""
    from kernels.attention_ref import paged_attention_ref
    from kernels.triton_attention import choose_num_kv_splits, paged_attention_triton

    scale = m.head_dim**-0.5
    for ctx in plan.decode_contexts:
        for batch in plan.decode_batches:
            if b.out_of_time():
                continue
            q_lens, seq_lens = [1] * batch, [ctx] * batch
            q, kc, vc, meta = make_paged_batch(b, m, q_lens, seq_lens)
            auto = choose_num_kv_splits(batch, m.kv_heads, 1, ctx, sms)
            checked = batch * ctx <= plan.check_cap_tokens
            ref = paged_attention_ref(q, kc, vc, meta, scale) if checked else None
            for variant, n in (("single", 1), ("split", auto if auto > 1 else 4)):
                out = torch.empty_like(q)
                run = partial(paged_attention_triton, q, kc, vc, meta, scale, out, num_splits=n)
                run()
                nbytes = attention_bytes(m, q_lens, seq_lens, b.elem)
                row = Row(
                    "decode_attn",
                    m.name,
                    f"batch={batch} ctx={ctx}",
                    f"{variant}/{n}",
                    b.time_ms(run),
                    nbytes,
                )
                row.err = rel_err(out, ref) if ref is not None else None
                row.extra = {"batch": batch, "ctx": ctx, "splits": n, "auto_splits": auto}
                b.add(row)


def sdpa_baseline_ms(b: Bench, m: ModelShape, n: int) -> float | None:
    """Causal SDPA over contiguous [1, heads, n, head_dim] tensors (flash backend on a GPU)."""
    if b.device != "cuda":
        return None
    import torch.nn.functional as F

    q = b.randn(1, m.heads, n, m.head_dim)
    k, v = b.randn(1, m.kv_heads, n, m.head_dim), b.randn(1, m.kv_heads, n, m.head_dim)
    try:
        return b.time_ms(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True))
    except (RuntimeError, TypeError) as exc:  # older torch without enable_gqa, or no fused kernel
        print(f"  (SDPA baseline unavailable: {exc})")
        return None


def bench_prefill(b: Bench, m: ModelShape, plan: Plan) -> None:
    """Whole prompts, a chunk over cached context, and a chunk mixed with decodes in one launch."""
    from kernels.attention_ref import paged_attention_ref
    from kernels.triton_attention import paged_attention_triton

    scale = m.head_dim**-0.5
    chunk, decodes, dctx = plan.mixed
    cases = [(f"prefill={n}", [n], [n]) for n in plan.prefill_lens]
    cases.append((f"chunk={chunk}+ctx={chunk}", [chunk], [2 * chunk]))
    cases.append((f"chunk={chunk}+{decodes}dec@{dctx}", [chunk] + [1] * decodes, [chunk] + [dctx] * decodes))
    for label, q_lens, seq_lens in cases:
        if b.out_of_time():
            continue
        q, kc, vc, meta = make_paged_batch(b, m, q_lens, seq_lens)
        out = torch.empty_like(q)
        run = partial(paged_attention_triton, q, kc, vc, meta, scale, out)
        run()
        err = rel_err(out, paged_attention_ref(q, kc, vc, meta, scale))
        ms = b.time_ms(run)
        nbytes = attention_bytes(m, q_lens, seq_lens, b.elem)
        row = Row("prefill_attn", m.name, label, "unified", ms, nbytes, err=err)
        row.tflops = attention_flops(m, q_lens, seq_lens) / ms / 1e9
        if len(q_lens) == 1 and seq_lens[0] == q_lens[0]:
            row.baseline_ms = sdpa_baseline_ms(b, m, q_lens[0])
        b.add(row)


SWEEP = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def sweep_decode(b: Bench, m: ModelShape, batch: int, ctx: int) -> None:
    """Launch configurations for one decode shape: what to retune if the default misses its target."""
    from kernels.triton_attention import paged_attention_triton

    scale = m.head_dim**-0.5
    q, kc, vc, meta = make_paged_batch(b, m, [1] * batch, [ctx] * batch)
    out = torch.empty_like(q)
    nbytes = attention_bytes(m, [1] * batch, [ctx] * batch, b.elem)
    for block_n, warps, stages in SWEEP:
        if b.out_of_time():
            continue
        run = partial(paged_attention_triton, q, kc, vc, meta, scale, out, num_splits=1,
                      block_n=block_n, num_warps=warps, num_stages=stages)  # fmt: skip
        try:
            ms = b.time_ms(run)
        except Exception as exc:  # e.g. out of shared memory for this configuration
            print(f"  sweep n={block_n} w={warps} s={stages}: {type(exc).__name__}")
            continue
        b.add(
            Row(
                "decode_sweep", m.name, f"batch={batch} ctx={ctx}", f"n{block_n}w{warps}s{stages}", ms, nbytes
            )
        )


# -- element-wise kernels ---------------------------------------------------------------------


def bench_elementwise(b: Bench, m: ModelShape, plan: Plan) -> None:
    for t in plan.elementwise_tokens:
        if b.out_of_time():
            continue
        for op in (_bench_kv_write, _bench_rmsnorm, _bench_rotary, _bench_silu):
            op(b, m, plan, t)


def _timed(
    b: Bench, kernel: str, m: ModelShape, t: int, tri: Callable, ref: Callable, nbytes: int, err: float
) -> None:
    """Time the Triton op and its torch reference (the eager baseline) on the same inputs."""
    ms, base = b.time_ms(tri), b.time_ms(ref)
    b.add(Row(kernel, m.name, f"tokens={t}", "triton", ms, nbytes, baseline_ms=base, err=err))


def _bench_kv_write(b: Bench, m: ModelShape, plan: Plan, t: int) -> None:
    """Scattered slots in a cache four times the batch, every eighth token skipped (-1)."""
    from kernels.kv_write import write_kv_ref
    from kernels.triton_kv_write import write_kv_triton

    key, value = b.randn(t, m.kv_heads, m.head_dim), b.randn(t, m.kv_heads, m.head_dim)
    blocks = -(-4 * t // b.block_size)
    slots = torch.randperm(blocks * b.block_size, generator=torch.Generator().manual_seed(2))[:t]
    slots[:: max(t // 8, 2)] = -1
    slots = slots.to(b.device)
    shape = (blocks, b.block_size, m.kv_heads, m.head_dim)
    caches = [torch.zeros(shape, dtype=b.dtype, device=b.device) for _ in range(4)]
    tri = partial(write_kv_triton, key, value, caches[0], caches[1], slots)
    ref = partial(write_kv_ref, key, value, caches[2], caches[3], slots)
    tri()
    ref()
    err = max(rel_err(caches[0], caches[2]), rel_err(caches[1], caches[3]))
    _timed(b, "kv_write", m, t, tri, ref, 4 * t * m.kv_heads * m.head_dim * b.elem, err)


def _bench_rmsnorm(b: Bench, m: ModelShape, plan: Plan, t: int) -> None:
    """Fused residual add + RMSNorm: reads x and residual, writes the output and the new residual."""
    from kernels.rmsnorm import rms_norm_ref
    from kernels.triton_rmsnorm import rms_norm_triton

    x, res, w = b.randn(t, m.hidden), b.randn(t, m.hidden), b.randn(m.hidden)
    tri = partial(rms_norm_triton, x, w, 1e-5, res)
    ref = partial(rms_norm_ref, x, w, 1e-5, res)
    (out, new_res), (ref_out, ref_res) = tri(), ref()
    err = max(rel_err(out, ref_out), rel_err(new_res, ref_res))
    _timed(b, "rmsnorm+res", m, t, tri, ref, 4 * t * m.hidden * b.elem, err)


def _bench_rotary(b: Bench, m: ModelShape, plan: Plan, t: int) -> None:
    """Rotary in place on q and k (repeated calls keep rotating; the cost does not change)."""
    from kernels.rotary import apply_rotary_ref, build_cos_sin_cache
    from kernels.triton_rotary import apply_rotary_triton

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, m.head_dim, 2).float() / m.head_dim))
    cos_sin = build_cos_sin_cache(inv_freq, plan.max_context).to(b.device)
    pos = torch.randint(0, plan.max_context, (t,), generator=torch.Generator().manual_seed(3)).to(b.device)
    q, k = b.randn(t, m.heads, m.head_dim), b.randn(t, m.kv_heads, m.head_dim)
    q2, k2 = q.clone(), k.clone()
    tri = partial(apply_rotary_triton, pos, q, k, cos_sin)
    ref = partial(apply_rotary_ref, pos, q2, k2, cos_sin)
    tri()
    ref()
    err = max(rel_err(q, q2), rel_err(k, k2))
    nbytes = 2 * t * (m.heads + m.kv_heads) * m.head_dim * b.elem + t * m.head_dim * 4
    _timed(b, "rotary", m, t, tri, ref, nbytes, err)


def _bench_silu(b: Bench, m: ModelShape, plan: Plan, t: int) -> None:
    """SiLU-and-mul over the fused gate/up projection: reads 2 * intermediate, writes intermediate."""
    from kernels.activation import silu_and_mul_ref
    from kernels.triton_activation import silu_and_mul_triton

    gu = b.randn(t, 2 * m.intermediate)
    tri, ref = partial(silu_and_mul_triton, gu), partial(silu_and_mul_ref, gu)
    err = rel_err(tri(), ref())
    _timed(b, "silu_and_mul", m, t, tri, ref, 3 * t * m.intermediate * b.elem, err)


# -- multi-LoRA -------------------------------------------------------------------------------


def lora_cases(plan: Plan) -> list[tuple[int, str]]:
    """(tokens, label): decode batches whose tokens use random adapters (some none), then a prefill
    chunk whose tokens all use one adapter (one request's chunk)."""
    cases = [(t, "mixed") for t in plan.lora_decode]
    return cases + ([(plan.lora_prefill, "1 adapter")] if plan.lora_prefill else [])


def lora_slots(t: int, label: str) -> list[int]:
    if label != "mixed":
        return [5] * t
    gen = torch.Generator().manual_seed(4 + t)
    return torch.randint(-1, LORA_SLOTS, (t,), generator=gen).tolist()  # about 1 in 17 without one


def lora_weights(b: Bench, d_in: int, d_out: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Stacked ``A``/``B`` scaled so that ``h`` and the added delta are O(1) like ``x`` and ``y``."""
    a = b.randn(LORA_SLOTS, rank, d_in) * d_in**-0.5
    bw = b.randn(LORA_SLOTS, d_out, rank) * rank**-0.5
    scales = torch.rand(LORA_SLOTS, generator=b.gen, device=b.device) + 0.5
    return a, bw, scales


def bench_lora(b: Bench, m: ModelShape, plan: Plan, summary: bool) -> None:
    """Shrink (hidden -> rank) and expand (rank -> q columns of a fused qkv output, in place).

    Bytes count what must move once: activations, the weights of the adapters present, ``h`` (fp32).
    ``extra["base_gemm_ms"]`` is the q projection itself (``x @ W.T``) at the same token count, to
    read the LoRA cost against.
    """
    from kernels.lora import LoraBatch, lora_expand_ref, lora_shrink_ref
    from kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    d_in, d_out = m.hidden, m.heads * m.head_dim
    qkv_cols = (m.heads + 2 * m.kv_heads) * m.head_dim
    for t, label in lora_cases(plan):
        if b.out_of_time():
            continue
        slots = lora_slots(t, label)
        batch = LoraBatch.build(slots, device=b.device)
        used = len(batch.groups)
        live = sum(s >= 0 for s in slots)
        x = b.randn(t, d_in)
        w = b.randn(d_out, d_in) * d_in**-0.5
        base_ms = b.time_ms(partial(torch.matmul, x, w.t()))
        for rank in plan.lora_ranks:
            if b.out_of_time():
                continue
            a, bw, scales = lora_weights(b, d_in, d_out, rank)
            extra = {"tokens": t, "rank": rank, "adapters": used, "base_gemm_ms": base_ms, "summary": summary}
            shape = f"tokens={t} r={rank}"
            tri = partial(lora_shrink_triton, x, a, batch.token_slots)
            ref = partial(lora_shrink_ref, x, a, batch)
            h, h_ref = tri(), ref()
            nbytes = (t * d_in + used * rank * d_in) * b.elem + t * rank * 4
            row = Row("lora_shrink", m.name, shape, label, b.time_ms(tri), nbytes, err=rel_err(h, h_ref))
            row.baseline_ms, row.tflops = b.time_ms(ref), 2.0 * live * rank * d_in / row.ms / 1e9
            row.extra = dict(extra)
            b.add(row)

            qkv = b.randn(t, qkv_cols)
            y_tri, y_ref = qkv.clone(), qkv.clone()
            lora_expand_triton(y_tri[:, :d_out], h_ref, bw, scales, batch.token_slots)
            lora_expand_ref(y_ref[:, :d_out], h_ref, bw, scales, batch)
            err = rel_err(y_tri, y_ref)
            y = y_tri[:, :d_out]  # timed in place: every call adds the delta again, the cost is the same
            tri = partial(lora_expand_triton, y, h_ref, bw, scales, batch.token_slots)
            ref = partial(lora_expand_ref, y_ref[:, :d_out], h_ref, bw, scales, batch)
            nbytes = 2 * live * d_out * b.elem + used * d_out * rank * b.elem + t * rank * 4
            row = Row("lora_expand", m.name, shape, label, b.time_ms(tri), nbytes, err=err)
            row.baseline_ms, row.tflops = b.time_ms(ref), 2.0 * live * rank * d_out / row.ms / 1e9
            row.extra = dict(extra)
            b.add(row)


# -- output -----------------------------------------------------------------------------------


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| kernel | model | shape | variant | ms | GB/s | % copy | TFLOP/s | baseline ms | check |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        tf = "" if r.tflops is None else f"{r.tflops:.1f}"
        base = "" if r.baseline_ms is None else f"{r.baseline_ms:.3f}"
        check = "" if r.err is None else f"{'ok' if r.ok else 'FAIL'} ({r.err:.0e})"
        lines.append(
            f"| {r.kernel} | {r.model} | {r.shape} | {r.variant} | {r.ms:.3f} | {r.gbs:,.0f} | "
            f"{r.pct_copy:.1f} | {tf} | {base} | {check} |"
        )
    return "\n".join(lines)


def _auto_decode(r: Row) -> bool:
    """A decode row timed with the split count the heuristic picks (what the engine runs)."""
    return r.kernel == "decode_attn" and r.extra["splits"] == r.extra["auto_splits"]


def decode_target(rows: list[Row]) -> float | None:
    """Worst % of copy bandwidth of the heuristic's choice at batch >= 32 and context >= 2048."""
    pct = [r.pct_copy for r in rows if _auto_decode(r) and r.extra["batch"] >= 32 and r.extra["ctx"] >= 2048]
    return min(pct) if pct else None


def _lora_summary(r: Row, plan: Plan) -> bool:
    """LoRA rows of the summary model at the largest decode batch and the prefill chunk."""
    big = (max(plan.lora_decode, default=0), plan.lora_prefill)
    return r.kernel.startswith("lora_") and r.extra["summary"] and r.extra["tokens"] in big


def summary_rows(rows: list[Row], plan: Plan) -> list[Row]:
    """A short selection: decode at batch 1/32/max on the longest context, biggest prefill, element-wise."""
    big_ctx, big_t = max(plan.decode_contexts), max(plan.elementwise_tokens)
    batches = {min(plan.decode_batches), 32, max(plan.decode_batches)}
    picked = []
    for r in rows:
        if _auto_decode(r):
            if r.extra["ctx"] == big_ctx and r.extra["batch"] in batches:
                picked.append(r)
        elif r.shape in (f"prefill={max(plan.prefill_lens)}", f"tokens={big_t}") or _lora_summary(r, plan):
            picked.append(r)
    return picked


def environment(b: Bench, sms: int) -> dict[str, Any]:
    import triton

    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if b.device == "cuda" else "cpu (Triton interpreter)",
        "sms": sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": str(b.dtype).removeprefix("torch."),
        "block_size": b.block_size,
        "copy_gbs": round(b.copy_gbs, 1),
    }
    return env


def write_results(out_dir: Path, env: dict[str, Any], b: Bench, plan: Plan) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    worst = decode_target(b.rows)
    target = (
        "n/a"
        if worst is None
        else f"{worst:.1f}% of copy bandwidth (target >= 70%: {'met' if worst >= 70 else 'NOT met'})"
    )
    short = markdown_table(summary_rows(b.rows, plan))
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "environment": env,
                "decode_target": worst,
                "failures": b.failures,
                "skipped": b.skipped,
                "rows": [asdict(r) for r in b.rows],
            },
            indent=1,
        )
    )
    header = (
        f"# Loom kernel benchmark\n\n{env['date']} on {env['device']} ({env['sms']} SMs); "
        f"torch {env['torch']}, "
        f"triton {env['triton']}, CUDA {env['cuda']}; {env['dtype']}, KV block size {env['block_size']}.\n"
        f"Device-to-device copy: {b.copy_gbs:,.0f} GB/s. Decode attention at batch >= 32, context >= 2048 "
        f"(split count chosen by the heuristic): worst {target}.\n"
        f"Checks against the torch reference: {len(b.failures)} failed. Configurations skipped for time: "
        f"{b.skipped}.\n"
    )
    (out_dir / "results.md").write_text(
        f"{header}\n## Summary\n\n{short}\n\n## All measurements\n\n{markdown_table(b.rows)}\n"
    )
    return f"{header}\n{short}"


# -- compile-only -----------------------------------------------------------------------------


@contextlib.contextmanager
def capture_launches() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Make ``kernel[grid](...)`` record (kernel, args, kwargs) instead of launching."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, tuple, dict]] = []
    original = JITFunction.__getitem__

    def record(self: JITFunction, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append((self, args, kwargs))

    JITFunction.__getitem__ = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = original  # type: ignore[method-assign]


def compile_launch(kernel: Any, args: tuple, kwargs: dict, arch: int) -> tuple[float, int]:
    """Compile one recorded launch for ``sm_<arch>``, specializing arguments as the JIT would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", arch, 32))
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(kernel.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in options})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = bound[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        ty, attr = native_specialize_impl(type(backend), value, False, True, True)
        signature[p.name] = ty
        if ty == "constexpr":  # e.g. an int equal to 1
            constexprs[p.name] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return time.perf_counter() - t0, int(compiled.metadata.shared)


def compile_only(arch: int, quick: bool) -> int:
    """Drive every wrapper the benchmark uses on CPU tensors, compiling each distinct launch.

    ``quick`` (what the test suite runs) compiles the bf16 variants only, without the sweep.
    """
    import kernels.triton_attention as ta
    from kernels.triton_common import interpreting

    if interpreting():
        print("--compile-only needs TRITON_INTERPRET unset (the interpreter replaces the compiler)")
        return 2
    ta._gpu_tuned = lambda q: True  # pick the GPU tile shapes and tensor-core dots
    sms = 132
    ta.num_programs_hint = lambda device: sms
    import kernels.triton_lora as tlora

    tlora._gpu_tuned = lambda t: True
    tlora.num_programs_hint = lambda device: sms
    b = Bench("cpu", torch.bfloat16, 16, budget_s=1e9)
    plan = Plan((1, 3), (520,), (300,), (130, 3, 600), (5,), 1024, 0, (1, 64), 600, (16, 64))
    with capture_launches() as launches:
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32):
            b.dtype = dtype
            for m in MODELS:
                _drive_wrappers(b, m, plan, sms, sweep=not quick)
    seen: dict[str, tuple] = {}
    for kernel, args, kwargs in launches:
        key = (
            f"{kernel.__name__}:"
            + ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if not isinstance(v, torch.Tensor))
            + ":"
            + ",".join(str(a.dtype) if isinstance(a, torch.Tensor) else str(a == 1) for a in args)
        )
        seen.setdefault(key, (kernel, args, kwargs))
    failed = 0
    for kernel, args, kwargs in seen.values():
        consts = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        try:
            secs, smem = compile_launch(kernel, args, kwargs, arch)
            print(f"ok   {kernel.__name__:<26} {secs:5.1f}s smem={smem // 1024:>3} KiB {consts}")
        except Exception as exc:
            failed += 1
            print(f"FAIL {kernel.__name__:<26} {consts}\n{exc}")
    print(f"{len(seen) - failed}/{len(seen)} kernel variants compile for sm_{arch}")
    return 1 if failed else 0


def _drive_wrappers(b: Bench, m: ModelShape, plan: Plan, sms: int, sweep: bool) -> None:
    """Run each wrapper once per launch shape the benchmark uses (launches are only recorded)."""
    from kernels.rotary import build_cos_sin_cache
    from kernels.triton_activation import silu_and_mul_triton
    from kernels.triton_attention import choose_num_kv_splits, paged_attention_triton
    from kernels.triton_kv_write import write_kv_triton
    from kernels.triton_rmsnorm import rms_norm_triton
    from kernels.triton_rotary import apply_rotary_triton

    scale = m.head_dim**-0.5
    for batch in plan.decode_batches:
        for ctx in plan.decode_contexts:
            q, kc, vc, meta = make_paged_batch(b, m, [1] * batch, [ctx] * batch)
            auto = choose_num_kv_splits(batch, m.kv_heads, 1, ctx, sms)
            for n in (1, max(auto, 2)):
                paged_attention_triton(q, kc, vc, meta, scale, num_splits=n)
    chunk, decodes, dctx = plan.mixed
    for q_lens, seq_lens in (
        ([plan.prefill_lens[0]], [plan.prefill_lens[0]]),
        ([16], [16]),
        ([chunk] + [1] * decodes, [chunk] + [dctx] * decodes),
    ):
        q, kc, vc, meta = make_paged_batch(b, m, q_lens, seq_lens)
        paged_attention_triton(q, kc, vc, meta, scale)
    if sweep and b.dtype == torch.bfloat16 and m is MODELS[-1]:
        q, kc, vc, meta = make_paged_batch(b, m, [1] * 8, [4096] * 8)
        for block_n, warps, stages in SWEEP:
            paged_attention_triton(
                q,
                kc,
                vc,
                meta,
                scale,
                num_splits=1,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
            )
    t = plan.elementwise_tokens[0]
    key, value = b.randn(t, m.kv_heads, m.head_dim), b.randn(t, m.kv_heads, m.head_dim)
    cache = torch.zeros(4, b.block_size, m.kv_heads, m.head_dim, dtype=b.dtype)
    write_kv_triton(key, value, cache, cache.clone(), torch.arange(t))
    x = b.randn(t, m.hidden)
    rms_norm_triton(x, b.randn(m.hidden), 1e-5, x.clone())
    rms_norm_triton(x, b.randn(m.hidden), 1e-5)
    cos_sin = build_cos_sin_cache(torch.ones(m.head_dim // 2), 16)
    apply_rotary_triton(
        torch.arange(t), b.randn(t, m.heads, m.head_dim), b.randn(t, m.kv_heads, m.head_dim), cos_sin
    )
    silu_and_mul_triton(b.randn(t, 2 * m.intermediate))
    _drive_lora(b, m, plan)


def _drive_lora(b: Bench, m: ModelShape, plan: Plan) -> None:
    """LoRA launches at every token count and rank the benchmark uses (tile shapes depend on both)."""
    from kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    d_in, d_out = m.hidden, m.heads * m.head_dim
    for t, label in lora_cases(plan):
        slots = torch.tensor(lora_slots(t, label), dtype=torch.int32)
        x, y = b.randn(t, d_in), b.randn(t, d_out + 64)[:, :d_out]
        for rank in plan.lora_ranks:
            a, bw, scales = lora_weights(b, d_in, d_out, rank)
            h = lora_shrink_triton(x, a, slots)  # recorded, not run: h is just a buffer of the right shape
            lora_expand_triton(y, h, bw, scales, slots)


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or "kernel-bench-results", help="results directory"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    ap.add_argument(
        "--budget-s", type=float, default=240.0, help="stop starting new configurations after this"
    )
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode launch-configuration sweep")
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny shapes through the Triton interpreter on CPU"
    )
    ap.add_argument(
        "--compile-only", action="store_true", help="compile every kernel variant for sm_90, no GPU"
    )
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only")
    ap.add_argument("--quick", action="store_true", help="--compile-only: bf16 variants only, no sweep")
    args = ap.parse_args(argv)

    if args.compile_only:
        return compile_only(args.arch, args.quick)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernels.triton_* import decorates a kernel
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("no CUDA device: run with --dry-run (interpreter) or --compile-only")
        return 2
    from kernels.triton_common import interpreting, num_programs_hint

    if device == "cuda" and interpreting():
        print("TRITON_INTERPRET is set: unset it to benchmark the compiled kernels")
        return 2
    plan, models = (DRY, [TINY]) if args.dry_run else (FULL, MODELS)
    b = Bench(device, getattr(torch, args.dtype), args.block_size, args.budget_s)
    sms = num_programs_hint(torch.device(device))
    t0 = time.monotonic()
    b.measure_copy()
    for m in models:
        bench_decode(b, m, plan, sms)
        bench_prefill(b, m, plan)
        bench_elementwise(b, m, plan)
        bench_lora(b, m, plan, summary=m is models[-1])
    if not args.no_sweep and device == "cuda":
        sweep_decode(b, MODELS[-1], 64, 4096)
    env = environment(b, sms)
    short = write_results(Path(args.out), env, b, plan)
    if b.failures:
        print("\nFAILED checks against the reference:\n" + "\n".join(b.failures))
    print(f"\nresults in {args.out}/results.{{json,md}} after {time.monotonic() - t0:.0f} s\n")
    print(short)  # the short Markdown table comes last
    return 1 if b.failures else 0


if __name__ == "__main__":
    sys.exit(main())
