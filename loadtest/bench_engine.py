"""Engine throughput: continuous batching vs static (cohort) batching vs Hugging Face ``generate``.

All three modes serve the same seeded workload in one process run, one after another: chat prompts
of varied length, output lengths drawn from a heavy-tailed distribution (a few tokens to several
hundred, exact via ignore-eos), all submitted at once. Static batching pays for the longest member
of every cohort, which is the case continuous batching exists for.

It also measures this machine (memory bandwidth, fp32 matmul rate) and times a saturated decode step
against the roofline those give: max(weights + KV bytes / bandwidth, FLOPs / matmul rate).

Writes ``engine.json`` and ``engine.md`` under ``--out`` (default ``loadtest/results``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.api import (
    Checkpoint,
    EngineConfig,
    GenerationRequest,
    LLMEngine,
    SamplingParams,
    SchedulingMode,
    load_checkpoint,
)

RESULTS_DIR = Path(__file__).parent / "results"

_WORDS = (
    "weave",
    "loom",
    "thread",
    "pattern",
    "color",
    "market",
    "river",
    "mountain",
    "history",
    "science",
    "music",
    "garden",
    "winter",
    "machine",
    "language",
    "story",
    "ocean",
    "forest",
    "city",
    "travel",
    "recipe",
    "planet",
    "energy",
    "memory",
    "friend",
    "design",
)
_ASKS = [
    "Explain {a} and {b} to a child.",
    "Write a short poem about {a}.",
    "Give three facts about {a}, {b} and {c}.",
    "What is the link between {a} and {b}? Answer in detail, with examples about {c} and {d}.",
    "Summarize the idea of {a}.",
    "Tell a story about a {a} that found a {b} near the {c}, then went to the {d} and met a {e}.",
]


@dataclass(frozen=True)
class WorkItem:
    prompt_ids: list[int]
    max_tokens: int


def make_workload(ckpt: Checkpoint, n: int, seed: int, max_output: int = 400) -> list[WorkItem]:
    """Seeded chat prompts with log-normal output lengths (median ~40) clipped to [4, max_output]."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        words = {k: rng.choice(_WORDS) for k in "abcde"}
        text = rng.choice(_ASKS).format(**words)
        ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": text}])
        out = int(min(max_output, max(4, rng.lognormvariate(math.log(40), 1.1))))
        items.append(WorkItem(ids, out))
    return items


def _summary(
    name: str, items: list[WorkItem], wall: float, occupancy: list[int], capacity: int
) -> dict[str, Any]:
    out_tokens = sum(w.max_tokens for w in items)
    return {
        "mode": name,
        "requests": len(items),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(items) / wall, 4),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "decode_steps": len(occupancy),
        "mean_batch_size": round(statistics.fmean(occupancy), 2) if occupancy else 0.0,
        "mean_batch_occupancy": round(statistics.fmean(occupancy) / capacity, 4) if occupancy else 0.0,
    }


def run_engine(
    ckpt: Checkpoint,
    items: list[WorkItem],
    mode: SchedulingMode,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> dict[str, Any]:
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, scheduling=mode
        ),
        ckpt,
    )
    for i, w in enumerate(items):
        engine.add_request(
            GenerationRequest(
                f"{mode}-{i}", w.prompt_ids, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
            )
        )
    occupancy: list[int] = []
    produced = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.token_ids) for o in engine.step())
        occupancy.append(engine.stats().last_step_seqs)  # live requests only, padding excluded
    wall = time.perf_counter() - t0
    expected = sum(w.max_tokens for w in items)
    if produced != expected:
        raise RuntimeError(f"{mode}: produced {produced} tokens, expected {expected}")
    result = _summary(str(mode), items, wall, occupancy, max_num_seqs)
    result["preemptions"] = engine.stats().num_preemptions
    return result


def run_hf_static(ckpt: Checkpoint, items: list[WorkItem], batch_size: int) -> dict[str, Any]:
    """Hugging Face ``generate`` over fixed cohorts: each runs until its longest member is done."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = LlamaForCausalLM(LlamaConfig(**ckpt.config.to_hf_dict())).eval()
    model.load_state_dict(ckpt.weights, strict=False)
    model.tie_weights()
    pad = ckpt.tokenizer.eos_token_ids[0]
    occupancy: list[int] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(items), batch_size):
            cohort = items[start : start + batch_size]
            width = max(len(w.prompt_ids) for w in cohort)
            ids = torch.full((len(cohort), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, w in enumerate(cohort):  # left padding, as decoder-only generation needs
                ids[r, width - len(w.prompt_ids) :] = torch.tensor(w.prompt_ids)
                mask[r, width - len(w.prompt_ids) :] = 1
            longest = max(w.max_tokens for w in cohort)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
            occupancy += [sum(1 for w in cohort if w.max_tokens > s) for s in range(longest)]
    wall = time.perf_counter() - t0
    return _summary("hf_static", items, wall, occupancy, batch_size)


def measure_machine() -> dict[str, float]:
    """Memory bandwidth (large copy: bytes read + written) and peak fp32 matmul rate, best of several."""
    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    bandwidth = 2 * src.numel() * 4 / min(copies)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm = []
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        mm.append(time.perf_counter() - t)
    return {
        "memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "matmul_gflop_s": round(2 * 2048**3 / min(mm) / 1e9, 1),
    }


def roofline_probe(ckpt: Checkpoint, batch: int, context: int, machine: dict[str, float]) -> dict[str, Any]:
    """Median decode step at ``batch`` sequences of ``context`` tokens vs the machine's roofline."""
    engine = LLMEngine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch, 2048)), ckpt)
    rng = random.Random(7)
    for i in range(batch):
        prompt = [rng.randrange(100, ckpt.config.vocab_size) for _ in range(context)]
        engine.add_request(GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True)))
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.num_waiting():
        engine.step()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    model = engine.model
    kv_bytes = batch * (context + 5) * engine.kv_cache.bytes_per_token()
    weight_bytes = model.weight_bytes()
    flops = batch * model.flops_per_token()
    attn_flops = batch * 4 * context * ckpt.config.q_size * ckpt.config.num_layers
    t_mem = (weight_bytes + kv_bytes) / (machine["memory_bandwidth_gb_s"] * 1e9)
    t_flop = (flops + attn_flops) / (machine["matmul_gflop_s"] * 1e9)
    roof = max(t_mem, t_flop)
    return {
        "batch": batch,
        "context": context,
        "step_ms": round(step * 1e3, 2),
        "roofline_ms": round(roof * 1e3, 2),
        "memory_bound_ms": round(t_mem * 1e3, 2),
        "compute_bound_ms": round(t_flop * 1e3, 2),
        "step_over_roofline": round(step / roof, 3),
        "tokens_per_s": round(batch / step, 1),
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "gflop_per_step": round((flops + attn_flops) / 1e9, 2),
    }


# (batch, context) decode probes, from latency-bound to the compute-bound knee of a 2-core CPU.
ROOFLINE_POINTS = [(16, 256), (64, 256), (128, 128), (256, 64)]


def add_roofline(report: dict[str, Any], ckpt: Checkpoint, points: list[tuple[int, int]], log: Any) -> None:
    """Measure the machine, then each probe; the saturation point is the one with most tokens/s."""
    log("measuring the machine and the roofline ...")
    report["machine"] = measure_machine()
    probes = []
    for batch, context in points:
        probes.append(roofline_probe(ckpt, batch, context, report["machine"]))
        log(f"  {probes[-1]}")
    report["roofline_points"] = probes
    report["roofline"] = max(probes, key=lambda p: p["tokens_per_s"])


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }


def to_markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        "# Engine benchmark",
        "",
        f"Model {report['model']} ({report['dtype']}, {report['device']}), {w['requests']} requests "
        f"(seed {w['seed']}), output tokens {w['output_min']}-{w['output_max']} "
        f"(mean {w['output_mean']:.0f}, median {w['output_median']}), "
        f"prompts {w['prompt_min']}-{w['prompt_max']} "
        f"tokens, all submitted at once; max_num_seqs {w['max_num_seqs']} (HF cohorts of the same size), "
        f"token budget {w['max_num_batched_tokens']}.",
        "",
        "| mode | requests/s | output tokens/s | mean batch | occupancy | wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("continuous", "static", "static_no_padding", "hf_static"):
        m = report["modes"].get(name)
        if m:
            lines.append(
                f"| {name} | {m['requests_per_s']:.3f} | {m['output_tokens_per_s']:.1f} "
                f"| {m['mean_batch_size']:.1f} | {m['mean_batch_occupancy']:.0%} | {m['wall_s']:.1f} |"
            )
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in report["ratios"].items()]
    r = report.get("roofline")
    if r:
        mach = report["machine"]
        lines += [
            "",
            f"Decode steps against this CPU's roofline: max(weight + KV bytes at "
            f"{mach['memory_bandwidth_gb_s']} GB/s measured copy bandwidth, FLOPs at "
            f"{mach['matmul_gflop_s']} GFLOP/s measured fp32 GEMM rate). Median of 10 steps.",
            "",
            "| batch | context | step ms | decode tokens/s | memory-bound ms | compute-bound ms "
            "| step / roofline |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in report.get("roofline_points", [r]):
            mark = " (saturation)" if p is r or p == r else ""
            lines.append(
                f"| {p['batch']}{mark} | {p['context']} | {p['step_ms']:.1f} | {p['tokens_per_s']:.0f} "
                f"| {p['memory_bound_ms']:.1f} | {p['compute_bound_ms']:.1f} "
                f"| {p['step_over_roofline']:.2f}x |"
            )
        lines += [
            "",
            f"At saturation (the batch with the most decode tokens/s) a step takes "
            f"**{r['step_over_roofline']:.2f}x** the roofline.",
        ]
    v = report["versions"]
    lines += [
        "",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + f". Date {report['date']}.",
    ]
    return "\n".join(lines) + "\n"


def run_benchmark(
    ckpt: Checkpoint,
    n: int = 128,
    seed: int = 0,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 512,
    max_output: int = 400,
    hf: bool = True,
    roofline_points: list[tuple[int, int]] | None = ROOFLINE_POINTS,
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:
    items = make_workload(ckpt, n, seed, max_output)
    outs = [w.max_tokens for w in items]
    prompts = [len(w.prompt_ids) for w in items]
    report: dict[str, Any] = {
        "model": ckpt.name,
        "dtype": "float32",
        "device": "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "workload": {
            "requests": n,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "output_min": min(outs),
            "output_max": max(outs),
            "output_mean": statistics.fmean(outs),
            "output_median": statistics.median(outs),
            "output_tokens": sum(outs),
            "prompt_min": min(prompts),
            "prompt_max": max(prompts),
            "output_distribution": f"lognormal(median 40, sigma 1.1) clipped to [4, {max_output}]",
            "arrival": "all at t=0",
        },
        "versions": versions(),
        "modes": {},
    }

    def save_partial() -> None:  # a crash late in a long run keeps what was measured
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "engine.partial.json").write_text(json.dumps(report, indent=2) + "\n")

    for mode in SchedulingMode:
        log(f"running {mode} ...")
        report["modes"][str(mode)] = run_engine(ckpt, items, mode, max_num_seqs, max_num_batched_tokens)
        log(f"  {report['modes'][str(mode)]}")
        save_partial()
    if hf:
        log("running hf_static ...")
        report["modes"]["hf_static"] = run_hf_static(ckpt, items, max_num_seqs)
        log(f"  {report['modes']['hf_static']}")
        save_partial()
    modes = report["modes"]
    cont = modes["continuous"]["output_tokens_per_s"]
    ratios = {
        "continuous_over_static": cont / modes["static"]["output_tokens_per_s"],
        "continuous_over_static_no_padding": cont / modes["static_no_padding"]["output_tokens_per_s"],
    }
    if hf:
        ratios["continuous_over_hf_static"] = cont / modes["hf_static"]["output_tokens_per_s"]
    report["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    if roofline_points:
        add_roofline(report, ckpt, roofline_points, log)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "engine.md").write_text(to_markdown(report))
        (out_dir / "engine.partial.json").unlink(missing_ok=True)
        log(f"wrote {out_dir / 'engine.json'} and {out_dir / 'engine.md'}")
    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine", help="continuous vs static vs HF generate on a seeded workload (~10 min on CPU)"
    )
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baseline")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline probes")
    p.add_argument(
        "--roofline-only",
        action="store_true",
        help="re-measure only the roofline section of an existing engine.json in --out",
    )
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    ckpt = load_checkpoint(args.model)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.roofline_only:
        report = json.loads((args.out / "engine.json").read_text())
        add_roofline(report, ckpt, ROOFLINE_POINTS, log)
        (args.out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "engine.md").write_text(to_markdown(report))
        print(to_markdown(report))
        return 0
    report = run_benchmark(
        ckpt,
        args.requests,
        args.seed,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        args.max_output,
        hf=not args.no_hf,
        roofline_points=None if args.no_roofline else ROOFLINE_POINTS,
        out_dir=args.out,
        log=log,
    )
    print(to_markdown(report))
    return 0
