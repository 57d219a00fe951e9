"""``loom bench calibrate``: fit the cost model's CPU variant to the real engine on this machine, and say
how wrong it is.

The GPU numbers of the simulator cannot be checked here, but its method can: the same cost model
with this CPU's measured copy bandwidth and fp32 GEMM rate, plus fitted efficiencies and host costs,
should predict the real engine's step times, and the simulator driven by it should predict a whole
run's wall time and latencies. The real engine (``LLMEngine`` with the embedded SmolLM2-135M, fp32)
serves four short seeded workloads, each three times (per-step minimum: see ``trace_engine``);
every step's batch (new tokens and cached context per sequence) and duration is recorded. The fit
uses the two runs named ``fit-*`` (batch widths 12 and 24); the other two (width 8, and static
batching) are held out, and the reported error is theirs.

Fitted form (the same as on a GPU, loadtest/costmodel.py): a CPU core does not overlap memory and
compute the way a GPU's streaming multiprocessors do, so both ``max`` and sum are tried:

    t = combine(t_mem / mem_eff, t_compute / compute_eff) + host_step + host_per_seq * seqs
        + host_per_token * tokens

(efficiencies on log grids relative to the measured rates, the three host costs by non-negative
least squares on relative error, one refit without the worst-fitting steps).
Runs in about three minutes on two cores; writes calibration.json and calibration.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from common import Priority
from loadtest.costmodel import Deployment, Hardware, ModelShape, StepItem, cpu_hardware, step_cost
from loadtest.generator import PlannedRequest
from loadtest.markdown import render
from loadtest.simulator import EngineSpec, Simulator
from loadtest.static_batching import Batching
from loadtest.stats import percentile
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from worker.api import Checkpoint, LLMEngine, load_checkpoint

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class CalibrationRun:
    """One real-engine run: a seeded workload and the engine settings it is served with."""

    name: str
    seed: int
    requests: int
    max_num_seqs: int
    max_num_batched_tokens: int
    mode: Batching = Batching.CONTINUOUS


RUNS = [
    # Fitted on: two batch widths, so that per-sequence costs and bandwidth are told apart.
    CalibrationRun("fit-12", 0, 36, 12, 192),
    CalibrationRun("fit-24", 3, 48, 24, 384),
    # Held out: another width, and static batching.
    CalibrationRun("holdout-batch8", 1, 32, 8, 128),
    CalibrationRun("holdout-static", 2, 24, 16, 256, Batching.STATIC),
]


@dataclass
class Step:
    items: list[StepItem]
    seconds: float


@dataclass
class Trace:
    run: CalibrationRun
    workload: list[tuple[int, int]]  # (prompt tokens, output tokens)
    steps: list[Step]
    wall_s: float
    ttft_s: list[float]
    e2e_s: list[float]
    num_blocks: int
    block_size: int
    raw_walls: list[float] = field(default_factory=list)  # each pass's own wall time, stalls included


def workload(seed: int, n: int) -> list[tuple[int, int]]:
    """Prompt lengths lognormal(48, 0.6) in [8, 256]; outputs lognormal(32, 1.0) in [4, 200] tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(min(256, max(8, rng.lognormvariate(math.log(48), 0.6))))
        o = int(min(200, max(4, rng.lognormvariate(math.log(32), 1.0))))
        out.append((p, o))
    return out


def _serve_once(engine: LLMEngine, ckpt: Checkpoint, run: CalibrationRun, rep: int) -> tuple[Any, ...]:
    """One pass of the run's workload: per step (its batch, its duration); per request the index of
    the step that gave its first token and of the one that ended it; and the pass's wall time."""
    rng = random.Random(f"prompts:{run.seed}")
    items = workload(run.seed, run.requests)
    vocab = ckpt.config.vocab_size
    for i, (p, o) in enumerate(items):
        prompt = [rng.randrange(100, vocab) for _ in range(p)]
        engine.add_request(
            GenerationRequest(f"c{rep}-{i}", prompt, SamplingParams(max_tokens=o, ignore_eos=True))
        )
    durations: list[float] = []
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    # Each step's batch as the cost model reads it: the engine's trace rows, as scheduled.
    batches: list[list[StepItem]] = []
    stop_tracing = engine.add_step_observer(
        lambda t: batches.append([StepItem(r.num_tokens, r.num_computed_tokens, r.samples) for r in t.rows])
    )
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            durations.append(time.perf_counter() - ts)
            for o in outs:
                if o.token_ids and o.request_id not in first:
                    first[o.request_id] = len(durations) - 1
                if o.finished:
                    done[o.request_id] = len(durations) - 1
    finally:
        stop_tracing()
    wall = time.perf_counter() - t0
    ids = [f"c{rep}-{i}" for i in range(len(items))]
    return items, batches, durations, [first[i] for i in ids], [done[i] for i in ids], wall


def trace_engine(ckpt: Checkpoint, run: CalibrationRun, repeats: int = 3) -> Trace:
    """Serve the run's workload ``repeats`` times and keep each step's fastest duration.

    All requests are submitted at once and nothing in the engine's scheduling depends on time, so
    every pass schedules the very same batches (checked); the minimum over passes strips the
    stalls other jobs on this shared machine inflict, as a benchmark's best-of-N does. The run's
    wall time and its requests' TTFT and E2E are rebuilt from those per-step minima.
    """
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=run.max_num_seqs,
            max_num_batched_tokens=run.max_num_batched_tokens,
            scheduler_cls=run.mode.scheduler_cls,
            enable_prefix_caching=False,
        ),
        ckpt,
    )
    passes = [_serve_once(engine, ckpt, run, rep) for rep in range(repeats)]
    items, batches, _, first_idx, done_idx, _ = passes[0]
    for p in passes[1:]:
        if p[1] != batches or p[3] != first_idx:
            raise RuntimeError(f"{run.name}: the engine scheduled differently across passes")
    best = [min(p[2][k] for p in passes) for k in range(len(batches))]
    clock = list(itertools.accumulate(best))
    return Trace(
        run,
        items,
        [Step(b, d) for b, d in zip(batches, best, strict=True)],
        clock[-1],
        [clock[k] for k in first_idx],
        [clock[k] for k in done_idx],
        engine.block_manager.num_blocks,
        engine.block_manager.block_size,
        raw_walls=[p[5] for p in passes],
    )


# ---- the fit ----------------------------------------------------------------------------------------

# worker/dense.py sends matrices of fewer rows than this through plain F.linear instead of its
# prepacked oneDNN weights; on this machine that path is several times slower (the lm_head at 7 rows:
# 57 ms plain vs 2.7 ms packed). A roofline model cannot know that, so such steps are told apart.
SMALL_GEMM_ROWS = 8


def is_small_gemm(step: Step) -> bool:
    """A step with a GEMM of 1-7 rows: fewer than 8 tokens, or 1-7 rows of logits."""
    tokens = sum(i.new_tokens for i in step.items)
    sampled = sum(i.samples for i in step.items)
    return tokens < SMALL_GEMM_ROWS or 0 < sampled < SMALL_GEMM_ROWS


def _features(dep: Deployment, steps: list[Step]) -> np.ndarray:
    """Per step: roofline memory and compute times at full efficiency, sequences, tokens."""
    bare = replace(dep, hw=replace(dep.hw, host_step_s=0.0, host_per_seq_s=0.0, host_per_token_s=0.0))
    rows = []
    for s in steps:
        c = step_cost(bare, s.items)
        rows.append((c.t_mem, c.t_compute, len(s.items), sum(i.new_tokens for i in s.items)))
    return np.asarray(rows, dtype=float)


def _fit_fast(dep: Deployment, steps: list[Step]) -> tuple[Hardware, np.ndarray]:
    """Best efficiencies on a log grid (both combine forms) with host costs by NNLS, least squared
    relative error; returns the hardware and each step's relative error."""
    F = _features(dep, steps)
    y = np.asarray([s.seconds for s in steps])
    X_host = np.column_stack([np.ones(len(y)), F[:, 2], F[:, 3]])
    # Relative to the measured rates. The copy bandwidth reads anywhere from 25 to 80 GB/s here from
    # run to run (caches, neighbours), so memory gets a wide range; the GEMM rate is steady and near
    # the cores' peak, so compute may not exceed it by more than measurement noise (1.5x).
    mem_grid = np.round(np.geomspace(0.1, 5.0, 28), 3)
    compute_grid = np.round(np.geomspace(0.1, 1.5, 20), 3)
    best: tuple[float, Hardware, np.ndarray] | None = None
    for overlap in (True, False):
        for em in mem_grid:
            for ec in compute_grid:
                gpu = np.maximum(F[:, 0] / em, F[:, 1] / ec) if overlap else F[:, 0] / em + F[:, 1] / ec
                coef = _nnls_rel(X_host, y, gpu)
                rel = (gpu + X_host @ coef - y) / y
                err = float(np.mean(rel**2))
                if best is None or err < best[0]:
                    hw = replace(
                        dep.hw,
                        mem_efficiency=float(em),
                        compute_efficiency=float(ec),
                        overlap=overlap,
                        host_step_s=float(coef[0]),
                        host_per_seq_s=float(coef[1]),
                        host_per_token_s=float(coef[2]),
                    )
                    best = (err, hw, rel)
    assert best is not None
    return best[1], best[2]


def fit(dep: Deployment, all_steps: list[Step]) -> Hardware:
    """The CPU variant's parameters from real steps.

    1. On the steps whose GEMMs all take the engine's fast path: efficiencies and host costs
       (``_fit_fast``); then once more without the steps that fit worst (relative error above three
       times the median), which are the ones another job stalled even in their fastest pass.
    2. The small-GEMM steps' extra time: the median of what that model leaves unexplained on them.
    """
    steps = [s for s in all_steps if not is_small_gemm(s)]
    hw, rel = _fit_fast(dep, steps)
    cut = 3 * float(np.median(np.abs(rel)))
    kept = [s for s, e in zip(steps, rel, strict=True) if abs(e) <= cut]
    if len(kept) >= 20:
        hw, _ = _fit_fast(dep, kept)
    small = [s for s in all_steps if is_small_gemm(s)]
    if small:
        base = Deployment(dep.model, hw, dep.tp)
        extra = statistics.median(s.seconds - step_cost(base, s.items).seconds for s in small)
        hw = replace(hw, small_gemm_rows=SMALL_GEMM_ROWS, small_gemm_extra_s=max(0.0, extra))
    return hw


def _nnls_rel(X: np.ndarray, y: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Host costs c >= 0 minimizing sum(((base + X c - y) / y)^2)."""
    w = 1.0 / y
    target = (y - base) * w
    best, best_err = np.zeros(X.shape[1]), math.inf
    for k in range(X.shape[1] + 1):
        for cols in itertools.combinations(range(X.shape[1]), k):
            coef = np.zeros(X.shape[1])
            if cols:
                sol, *_ = np.linalg.lstsq(X[:, cols] * w[:, None], target, rcond=None)
                if (sol < 0).any():
                    continue
                coef[list(cols)] = sol
            err = float(np.sum((X @ coef * w - target) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best


# ---- errors -----------------------------------------------------------------------------------------


def step_errors(dep: Deployment, steps: list[Step]) -> dict[str, float] | None:
    """Median and p90 of |predicted - measured| / measured per step, and the signed error of their sum."""
    if not steps:
        return None
    rel = [abs(step_cost(dep, s.items).seconds - s.seconds) / s.seconds for s in steps]
    signed = sum(step_cost(dep, s.items).seconds for s in steps) / sum(s.seconds for s in steps) - 1
    return {
        "steps": len(steps),
        "median_abs_err": statistics.median(rel),
        "p90_abs_err": float(percentile(rel, 90) or 0.0),
        "total_step_time_err": signed,
    }


def simulate_trace(dep: Deployment, trace: Trace) -> dict[str, float]:
    """The simulator on the trace's requests and engine settings vs what the engine measured."""
    reqs = [
        PlannedRequest(i, 0, 0.0, "calibration", Priority.STANDARD, p, o)
        for i, (p, o) in enumerate(trace.workload)
    ]
    spec = EngineSpec(
        max_num_seqs=trace.run.max_num_seqs,
        max_num_batched_tokens=trace.run.max_num_batched_tokens,
        block_size=trace.block_size,
        num_blocks=trace.num_blocks,
        mode=trace.run.mode,
        max_model_len=trace.num_blocks * trace.block_size,
    )
    res = Simulator(dep, spec).run(reqs)
    ttft = [r.ttft or 0.0 for r in res.records]
    e2e = [r.e2e or 0.0 for r in res.records]
    out = {
        "measured_wall_s": trace.wall_s,
        "simulated_wall_s": res.end_s,
        "wall_err": res.end_s / trace.wall_s - 1,
        "measured_steps": len(trace.steps),
        "simulated_steps": len(res.steps),
        "measured_ttft_mean_s": statistics.fmean(trace.ttft_s),
        "simulated_ttft_mean_s": statistics.fmean(ttft),
        "measured_e2e_p50_s": statistics.median(trace.e2e_s),
        "simulated_e2e_p50_s": statistics.median(e2e),
    }
    out["ttft_mean_err"] = out["simulated_ttft_mean_s"] / out["measured_ttft_mean_s"] - 1
    out["e2e_p50_err"] = out["simulated_e2e_p50_s"] / out["measured_e2e_p50_s"] - 1
    return out


def calibrate(ckpt: Checkpoint, log: Any = print, runs: list[CalibrationRun] = RUNS) -> dict[str, Any]:
    import torch

    from loadtest.bench_engine import measure_machine

    log("measuring the machine ...")
    first, second = measure_machine(), measure_machine()
    machine = {k: max(first[k], second[k]) for k in first}  # a busy machine only ever under-reads
    cpu = cpu_hardware(machine["memory_bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9)
    shape = ModelShape.from_config(ckpt.name, ckpt.config)
    roofline = Deployment(shape, cpu, 1)
    log("warming up the engine ...")
    trace_engine(ckpt, CalibrationRun("warmup", 99, 8, 8, 128), repeats=1)
    traces = []
    for run in runs:
        log(f"running {run.name} ...")
        traces.append(trace_engine(ckpt, run))
        walls = ", ".join(f"{w:.1f}" for w in traces[-1].raw_walls)
        log(
            f"  {len(traces[-1].steps)} steps, {traces[-1].wall_s:.1f} s from per-step minima "
            f"(passes: {walls} s)"
        )
    hw = fit(roofline, [s for tr in traces if tr.run.name.startswith("fit") for s in tr.steps])
    fitted = Deployment(shape, hw, 1)
    pure = Deployment(shape, replace(hw, small_gemm_rows=0, small_gemm_extra_s=0.0), 1)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": ckpt.name,
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "machine": machine,
        "fitted": hw.describe(),
        "effective_mem_bw_gb_s": hw.mem_bw * hw.mem_efficiency / 1e9,
        "effective_matmul_gflop_s": hw.matmul_rate * hw.compute_efficiency / 1e9,
        "gemm_paths_ms": gemm_paths(ckpt.config.vocab_size, ckpt.config.hidden_size),
        "runs": [],
    }
    for tr in traces:
        fast = [s for s in tr.steps if not is_small_gemm(s)]
        small = [s for s in tr.steps if is_small_gemm(s)]
        report["runs"].append(
            {
                "name": tr.run.name,
                "mode": str(tr.run.mode),
                "requests": tr.run.requests,
                "max_num_seqs": tr.run.max_num_seqs,
                "max_num_batched_tokens": tr.run.max_num_batched_tokens,
                "seed": tr.run.seed,
                "pass_walls_s": tr.raw_walls,
                "held_out": not tr.run.name.startswith("fit"),
                "small_gemm_time_share": sum(s.seconds for s in small) / sum(s.seconds for s in tr.steps),
                "step_err_fast": step_errors(fitted, fast),
                "step_err_small": step_errors(fitted, small),
                "step_err_roofline": step_errors(roofline, fast),
                "run_fitted": simulate_trace(fitted, tr),
                "run_pure": simulate_trace(pure, tr),
            }
        )
    held = [r for r in report["runs"] if r["held_out"]]
    report["summary"] = {
        "fit_step_median_abs_err": max(
            r["step_err_fast"]["median_abs_err"] for r in report["runs"] if not r["held_out"]
        ),
        "holdout_step_median_abs_err": max(r["step_err_fast"]["median_abs_err"] for r in held),
        "holdout_step_p90_abs_err": max(r["step_err_fast"]["p90_abs_err"] for r in held),
        "holdout_total_step_time_abs_err_max": max(
            abs(r["step_err_fast"]["total_step_time_err"]) for r in held
        ),
        "holdout_small_step_median_abs_err": max(
            (r["step_err_small"]["median_abs_err"] for r in held if r["step_err_small"]), default=None
        ),
        "holdout_wall_abs_err_max": max(abs(r["run_fitted"]["wall_err"]) for r in held),
        "holdout_wall_abs_err_max_without_small_gemm_term": max(abs(r["run_pure"]["wall_err"]) for r in held),
        "holdout_ttft_mean_abs_err_max": max(abs(r["run_fitted"]["ttft_mean_err"]) for r in held),
        "holdout_e2e_p50_abs_err_max": max(abs(r["run_fitted"]["e2e_p50_err"]) for r in held),
        "roofline_only_step_median_abs_err": max(r["step_err_roofline"]["median_abs_err"] for r in held),
        "fitted": report["fitted"],
    }
    return report


def gemm_paths(vocab: int, hidden: int, rows: tuple[int, ...] = (1, 2, 4, 7, 8, 16)) -> dict[str, Any]:
    """The lm_head GEMM through plain ``F.linear`` and through oneDNN-prepacked weights, per row count
    (fastest of 15 calls, as the machine is shared): the evidence behind SMALL_GEMM_ROWS."""
    import torch
    import torch.nn.functional as F

    w = torch.randn(vocab, hidden)
    out: dict[str, Any] = {"shape": [vocab, hidden], "rows": list(rows), "plain": [], "packed": []}
    packed = None
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    for m in rows:
        x = torch.randn(m, hidden)
        for name in ("plain", "packed"):
            if name == "packed" and packed is None:
                out[name].append(None)
                continue

            def call(x: torch.Tensor = x, name: str = name) -> Any:
                if name == "plain":
                    return F.linear(x, w)
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            call()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            out[name].append(round(min(times) * 1e3, 3))
    return out


def _ratio(g: dict[str, Any], lo: int, hi: int) -> str:
    """ "a-bx": the range of plain / packed time over rows lo..hi."""
    r = [
        p / k
        for m, p, k in zip(g["rows"], g["plain"], g["packed"], strict=True)
        if lo <= m <= hi and k is not None and k > 0
    ]
    if not r:
        return "(not measured)"
    return f"{min(r):.1f}x" if round(min(r), 1) == round(max(r), 1) else f"{min(r):.1f}-{max(r):.1f}x"


def _min_rows(g: dict[str, Any]) -> int:
    """The smallest row count from which the packed path is not slower (1, unless plain wins at 1)."""
    plain, packed = g["plain"][0], g["packed"][0]
    return 1 if packed is not None and packed <= plain else 2


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.1%}" if signed else f"{x:.1%}"


def to_markdown(rep: dict[str, Any]) -> str:
    return render(
        "calibration.md.j2",
        rep=rep,
        pct=_pct,
        ratio=_ratio,
        packed_min_rows=_min_rows(rep["gemm_paths_ms"]),
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the simulator's CPU cost model to the real engine here (~3 min)"
    )
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    report = calibrate(load_checkpoint(args.model), log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "calibration.md").write_text(to_markdown(report))
    print(to_markdown(report))
    return 0
