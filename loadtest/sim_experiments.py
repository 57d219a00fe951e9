"""``loom bench simulate``: the GPU-scale questions, answered by the simulator (deterministic, on a CPU).

1. **Static vs continuous** at saturation (every request submitted at once, as the engine benchmark
   does) for SmolLM2-135M, Llama-3-8B and Llama-3-70B (4-way tensor parallel) on H100 and H200:
   throughput and the utilization figures of docs/utilization.md.
2. **The knee** of each model: a Poisson rate sweep around its continuous saturation capacity;
   throughput against p50/p99 TTFT and ITL; the knee is the highest rate kept up with inside the
   SLO (loadtest.stats.find_knee). Static batching is swept on the same rates.
3. **KV waste**: paged blocks against contiguous reservations on the same resident sequences, and
   the same workload re-run with a real max-length reservation (one 4096-token block per sequence).
4. **Shared vs dedicated**: bursty out-of-phase tenants (workloads/sim-shared-vs-dedicated.yaml),
   each on its own endpoint vs one shared pool; the GPUs each needs for the same p99 TTFT SLO and
   the cost per million output tokens at a stated price per GPU-hour.

Writes ``simulator.json``, ``simulator.md`` and PNG plots under ``--out`` (default loadtest/results).
With ``--workload FILE`` it instead runs one workload file through one configuration (a what-if).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.costmodel import HARDWARE, LLAMA3_8B, LLAMA3_70B, MODELS, SMOLLM2_135M, Deployment
from loadtest.generator import PlannedRequest, plan_workload
from loadtest.markdown import render
from loadtest.simulator import EngineSpec, SimResult, Simulator
from loadtest.static_batching import Batching
from loadtest.stats import SloSpec, find_knee, keeps_up, sweep_point
from loadtest.workload import Workload, load_workload

RESULTS_DIR = Path(__file__).parent / "results"
WORKLOADS = Path(__file__).parent / "workloads"
REFERENCE = WORKLOADS / "sim-reference.yaml"
SHARED = WORKLOADS / "sim-shared-vs-dedicated.yaml"

# (model, tensor-parallel degree): the 70B needs 4 GPUs (141 GB of bf16 weights).
MODEL_SETUPS = [(SMOLLM2_135M, 1), (LLAMA3_8B, 1), (LLAMA3_70B, 4)]
MODES = [Batching.CONTINUOUS, Batching.STATIC, Batching.STATIC_NO_PADDING]

Log = Callable[[str], None]


def _r(x: Any, nd: int = 4) -> Any:
    if isinstance(x, float):
        return x if math.isinf(x) or math.isnan(x) else round(x, nd)
    if isinstance(x, dict):
        return {k: _r(v, nd) for k, v in x.items()}
    if isinstance(x, list):
        return [_r(v, nd) for v in x]
    return x


def all_at_once(workload: Workload, n: int) -> list[PlannedRequest]:
    """``n`` requests of the workload's length and priority mix, all arriving at t=0."""
    plan = plan_workload(workload, rate=1000.0, duration_s=max(1.0, n / 1000.0 * 2), max_requests=n)
    return [replace(r, at_s=0.0) for r in plan.requests]


def _slo(workload: Workload) -> SloSpec:
    return SloSpec(workload.slo.ttft_s, workload.slo.itl_s)


def _headline(res: SimResult, slo: SloSpec, window: float | None = None) -> dict[str, Any]:
    s = res.summary(slo, window)
    o, u = s["stats"]["overall"], s["utilization"]
    devices = s["devices"]
    return {
        "requests": o["requests"],
        "output_tokens": o["output_tokens"],
        "wall_s": res.end_s,
        "requests_per_s": o["requests_per_s"],
        "output_tokens_per_s": o["output_tokens_per_s"],
        "output_tokens_per_s_per_gpu": o["output_tokens_per_s"] / devices,
        "ttft_p50_s": o["ttft_s"]["p50"],
        "ttft_p99_s": o["ttft_s"]["p99"],
        "itl_p50_s": o["itl_s"]["p50"],
        "itl_p99_s": o["itl_s"]["p99"],
        "utilization": u,
    }


# ---- 1. static vs continuous at saturation -----------------------------------------------------------


def saturation(workload: Workload, n: int, hardware: list[str], log: Log) -> list[dict[str, Any]]:
    reqs = all_at_once(workload, n)
    rows = []
    for hw in hardware:
        for model, tp in MODEL_SETUPS:
            dep = Deployment(model, HARDWARE[hw], tp)
            for mode in MODES:
                t = time.perf_counter()
                res = Simulator(dep, EngineSpec(mode=mode)).run(reqs)
                row = {"model": model.name, "hardware": hw, "tp": tp, "mode": str(mode)}
                row.update(_headline(res, _slo(workload)))
                rows.append(row)
                log(
                    f"  saturation {dep.name} {mode}: {row['output_tokens_per_s']:.0f} tok/s "
                    f"({time.perf_counter() - t:.1f} s)"
                )
    return rows


# ---- 2. the knee -------------------------------------------------------------------------------------


def sweep_point_sim(
    workload: Workload,
    dep: Deployment,
    mode: Batching,
    rate: float,
    requests_per_point: int = 1200,
    replicas: int = 1,
) -> dict[str, Any]:
    """One Poisson stage at ``rate``: window = its arrival window (at least 15 s); requests still
    unfinished 60 s after the window are INCOMPLETE (infinitely late)."""
    slo = _slo(workload)
    window = min(120.0, max(15.0, requests_per_point / rate))
    plan = plan_workload(workload, rate=rate, duration_s=window, max_requests=100_000)
    res = Simulator(dep, EngineSpec(mode=mode), replicas=replicas).run(plan.requests, horizon_s=window + 60.0)
    summary = res.summary(slo, window)
    p = sweep_point(rate, res.records, window, slo)
    p["window_s"] = window
    p["ttft_p99_by_priority_s"] = {k: v["ttft_s"]["p99"] for k, v in summary["stats"]["priorities"].items()}
    u = summary["utilization"]
    for key in (
        "step_busy_fraction",
        "slot_occupancy",
        "mean_live_batch",
        "mbu_busy",
        "mbu_wall",
        "kv_blocks_used_mean",
        "kv_waste",
    ):
        p[key] = u.get(key)
    return p


def adaptive_sweep(
    workload: Workload, dep: Deployment, mode: Batching, start_rate: float, growth: float = 1.5
) -> list[dict[str, Any]]:
    """Rates growing by ``growth`` from ``start_rate`` until the system stops keeping up; then two
    points inside each of the two brackets (last rate within the SLO / first past it, last rate kept
    up with / first not) and one point 20% past the end, for the shape of the blow-up."""
    slo = workload.slo.ttft_s
    points = [sweep_point_sim(workload, dep, mode, start_rate)]
    while keeps_up(points[-1]) and len(points) < 16:
        points.append(sweep_point_sim(workload, dep, mode, round(points[-1]["offered_rps"] * growth, 4)))
    rates = [p["offered_rps"] for p in points]

    def bracket(ok: Callable[[dict[str, Any]], bool]) -> tuple[float, float] | None:
        for a, b in itertools.pairwise(points):
            if ok(a) and not ok(b):
                return a["offered_rps"], b["offered_rps"]
        return None

    extra: set[float] = set()
    for br in (
        bracket(lambda p: keeps_up(p) and p["ttft_p99_s"] <= slo),
        bracket(keeps_up),
    ):
        if br is not None:
            lo, hi = br
            extra |= {round(lo + (hi - lo) * i / 3, 4) for i in (1, 2)}
    extra.add(round(rates[-1] * 1.2, 4))
    points += [sweep_point_sim(workload, dep, mode, r) for r in sorted(extra - set(rates))]
    return sorted(points, key=lambda p: p["offered_rps"])


def knees(
    workload: Workload,
    capacity: dict[tuple[str, str], float],
    hardware: list[str],
    log: Log,
    static_hardware: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Sweep each model from a tenth of its all-at-once throughput until it no longer keeps up."""
    out = []
    for hw in hardware:
        for model, tp in MODEL_SETUPS:
            dep = Deployment(model, HARDWARE[hw], tp)
            start = round(0.1 * capacity[(model.name, hw)], 4)
            modes = [Batching.CONTINUOUS]
            if hw in (static_hardware if static_hardware is not None else hardware):
                modes.append(Batching.STATIC)
            for mode in modes:
                t = time.perf_counter()
                points = adaptive_sweep(workload, dep, mode, start)
                knee = find_knee(points, workload.slo.ttft_s)
                sustained = find_knee(points, math.inf)
                out.append(
                    {
                        "model": model.name,
                        "hardware": hw,
                        "tp": tp,
                        "mode": str(mode),
                        "points": points,
                        "knee": knee,
                        "max_sustained": sustained,
                    }
                )
                k = f"{knee['offered_rps']:.2f} req/s" if knee else "none"
                m = f"{sustained['offered_rps']:.2f}" if sustained else "none"
                log(f"  knee {dep.name} {mode}: {k}, sustained {m} ({time.perf_counter() - t:.1f} s)")
    return out


# ---- 3. KV waste ---------------------------------------------------------------------------------------


def kv_waste(workload: Workload, n: int, hardware: str, log: Log) -> list[dict[str, Any]]:
    """Paged vs a real max-length reservation, continuous batching, same requests, same KV memory."""
    reqs = all_at_once(workload, n)
    slo = _slo(workload)
    rows = []
    for model, tp in MODEL_SETUPS:
        dep = Deployment(model, HARDWARE[hardware], tp)
        for layout in ("paged", "contiguous"):
            res = Simulator(dep, EngineSpec(kv_layout=layout)).run(reqs)
            h = _headline(res, slo)
            u = h["utilization"]
            rows.append(
                {
                    "model": model.name,
                    "hardware": hardware,
                    "tp": tp,
                    "kv_layout": layout,
                    "kv_capacity_tokens": dep.kv_capacity_tokens,
                    "max_concurrent_seqs": (
                        min(EngineSpec().max_num_seqs, dep.kv_capacity_tokens // EngineSpec().max_model_len)
                        if layout == "contiguous"
                        else EngineSpec().max_num_seqs
                    ),
                    "mean_live_batch": u["mean_live_batch"],
                    "output_tokens_per_s": h["output_tokens_per_s"],
                    "ttft_p99_s": h["ttft_p99_s"],
                    "kv_waste": u["kv_waste"],
                    "kv_blocks_used_mean": u["kv_blocks_used_mean"],
                }
            )
            log(
                f"  kv {dep.name} {layout}: {h['output_tokens_per_s']:.0f} tok/s, "
                f"batch {u['mean_live_batch']:.0f}"
            )
    return rows


# ---- 4. shared vs dedicated ----------------------------------------------------------------------------


def _meets(res: SimResult, slo: SloSpec, window: float, tenants: list[str]) -> tuple[bool, dict[str, Any]]:
    """Every tenant's p99 TTFT within the SLO (the shared pool must serve each tenant as well)."""
    s = res.summary(slo, window)["stats"]
    p99 = {t: s["tenants"][t]["ttft_s"]["p99"] for t in tenants if t in s["tenants"]}
    ok = all(v is not None and v <= slo.ttft_s for v in p99.values())
    return ok, {"ttft_p99_by_tenant_s": p99, "overall": s["overall"]}


def _smallest_pool(
    dep: Deployment,
    reqs: list[PlannedRequest],
    slo: SloSpec,
    window: float,
    tenants: list[str],
    max_replicas: int,
    sustained_rps: float | None,
) -> tuple[int | None, SimResult | None, dict[str, Any]]:
    """The fewest replicas meeting the SLO, searched upwards from what the mean load alone needs
    (a replica sustains ``sustained_rps`` of this workload at most)."""
    detail: dict[str, Any] = {}
    first = max(1, math.ceil(len(reqs) / window / sustained_rps)) if sustained_rps else 1
    for k in range(first, max_replicas + 1):
        res = Simulator(dep, EngineSpec(), replicas=k).run(reqs, horizon_s=window + 120.0)
        ok, detail = _meets(res, slo, window, tenants)
        if ok:
            return k, res, detail
    return None, None, detail


def shared_vs_dedicated(
    workload: Workload,
    setups: list[tuple[str, int, str, float]],
    log: Log,
    sustained: dict[tuple[str, str], float] | None = None,
    max_replicas: int = 16,
) -> list[dict[str, Any]]:
    """For each (model, tp, hardware, rate scale): the dedicated and shared pool sizes and costs."""
    slo = _slo(workload)
    window = workload.duration_s
    tenants = [t.name for t in workload.tenants]
    out = []
    for model_name, tp, hw, scale in setups:
        scaled = _scaled(workload, scale)
        reqs = plan_workload(scaled).requests
        dep = Deployment(MODELS[model_name], HARDWARE[hw], tp)
        price = dep.hw.price_per_hour
        rps = (sustained or {}).get((model_name, hw))
        dedicated = []
        for t in tenants:
            own = [r for r in reqs if r.tenant == t]
            k, res, detail = _smallest_pool(dep, own, slo, window, [t], max_replicas, rps)
            assert res is not None, f"{t} needs more than {max_replicas} replicas"
            o = detail["overall"]
            dedicated.append(
                {
                    "tenant": t,
                    "replicas": k,
                    "gpus": k * tp,
                    "requests": len(own),
                    "output_tokens": o["output_tokens"],
                    "ttft_p99_s": detail["ttft_p99_by_tenant_s"][t],
                    "step_busy_fraction": res.utilization(window)["step_busy_fraction"],
                    "mbu_wall": res.utilization(window)["mbu_wall"],
                }
            )
            log(f"  dedicated {t} on {dep.name}: {k} replicas")
        k, res, detail = _smallest_pool(dep, reqs, slo, window, tenants, max_replicas * len(tenants), rps)
        assert res is not None
        u = res.utilization(window)
        tokens = detail["overall"]["output_tokens"]
        gpus_dedicated = sum(d["gpus"] for d in dedicated)
        hours = window / 3600.0

        def per_million(gpus: int, tok: float = tokens, price: float = price, hours: float = hours) -> float:
            return gpus * price * hours / (tok / 1e6)

        row = {
            "model": model_name,
            "hardware": hw,
            "tp": tp,
            "rate_scale": scale,
            "window_s": window,
            "price_per_gpu_hour_usd": price,
            "tenants": len(tenants),
            "offered_rps_mean": len(reqs) / window,
            "dedicated": dedicated,
            "dedicated_gpus": gpus_dedicated,
            "shared_replicas": k,
            "shared_gpus": k * tp,
            "shared_ttft_p99_by_tenant_s": detail["ttft_p99_by_tenant_s"],
            "shared_step_busy_fraction": u["step_busy_fraction"],
            "shared_mbu_wall": u["mbu_wall"],
            "dedicated_step_busy_fraction_mean": sum(d["step_busy_fraction"] * d["gpus"] for d in dedicated)
            / gpus_dedicated,
            "output_tokens": tokens,
            "cost_per_million_tokens_dedicated_usd": per_million(gpus_dedicated),
            "cost_per_million_tokens_shared_usd": per_million(k * tp),
            "gpu_saving": 1 - (k * tp) / gpus_dedicated,
        }
        out.append(row)
        log(f"  shared {dep.name}: {k} replicas ({k * tp} GPUs) vs {gpus_dedicated} GPUs dedicated")
    return out


def _scaled(workload: Workload, scale: float) -> Workload:
    """The workload with every tenant's arrival rates multiplied by ``scale`` (bigger models, less load)."""
    if scale == 1.0:
        return workload
    tenants = []
    for t in workload.tenants:
        a = t.arrival
        if a is not None:
            upd = {k: getattr(a, k) * scale for k in ("rate", "base_rate", "burst_rate") if hasattr(a, k)}
            a = a.model_copy(update=upd)
        tenants.append(t.model_copy(update={"arrival": a}))
    return workload.model_copy(update={"tenants": tenants})


# ---- the whole report --------------------------------------------------------------------------------------


def run_all(
    out_dir: Path | None,
    log: Log,
    quick: bool = False,
    calibration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    ref = load_workload(REFERENCE)
    shared = load_workload(SHARED)
    n = 512 if quick else 2048
    hardware = ["h100"] if quick else ["h100", "h200"]
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "quick": quick,
        "workloads": {"reference": ref.model_dump(mode="json"), "shared": shared.model_dump(mode="json")},
        "hardware": {k: v.describe() for k, v in HARDWARE.items()},
        "deployments": [
            Deployment(m, HARDWARE[h], tp).describe() for h in hardware for m, tp in MODEL_SETUPS
        ],
        "engine": EngineSpec().describe(),
    }
    log("1/4 static vs continuous at saturation ...")
    report["saturation"] = saturation(ref, n, hardware, log)
    capacity = {
        (r["model"], r["hardware"]): r["requests_per_s"]
        for r in report["saturation"]
        if r["mode"] == "continuous"
    }
    log("2/4 knees ...")
    report["knees"] = knees(ref, capacity, ["h100"] if quick else hardware, log, static_hardware=["h100"])
    sustained = {
        (k["model"], k["hardware"]): k["max_sustained"]["offered_rps"]
        for k in report["knees"]
        if k["mode"] == "continuous" and k["max_sustained"]
    }
    log("3/4 KV waste ...")
    report["kv"] = kv_waste(ref, n, "h100", log)
    log("4/4 shared vs dedicated ...")
    setups = [("llama-3-8b", 1, "h100", 1.0)]
    if not quick:
        setups.append(("llama-3-70b", 4, "h100", 0.5))
    report["shared_vs_dedicated"] = shared_vs_dedicated(shared, setups, log, sustained)
    if calibration is not None:
        report["calibration"] = calibration
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    report = _r(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "simulator.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out_dir / "simulator.md").write_text(to_markdown(report))
        plot_knees(report, out_dir)
        log(f"wrote {out_dir / 'simulator.json'}, simulator.md and plots")
    return report


# ---- Markdown and plots -----------------------------------------------------------------------------------


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


def _pct(x: Any) -> str:
    return _f(None if x is None else 100 * x, "{:.0f}%")


def _ms(x: Any) -> str:
    return _f(None if x is None else (x if isinstance(x, str) else x * 1e3), "{:.0f}")


def to_markdown(rep: dict[str, Any]) -> str:
    static_tps = {
        (r["model"], r["hardware"]): r["output_tokens_per_s"]
        for r in rep["saturation"]
        if r["mode"] == "static"
    }
    paged = {r["model"]: r for r in rep["kv"] if r["kv_layout"] == "paged"}
    kv_costs = []  # (contiguous run, paged run, the share of tokens/s lost) where KV memory binds
    for r in rep["kv"]:
        p = paged.get(r["model"])
        if r["kv_layout"] == "contiguous" and p and r["max_concurrent_seqs"] < p["max_concurrent_seqs"]:
            kv_costs.append((r, p, 1 - r["output_tokens_per_s"] / p["output_tokens_per_s"]))
    return render(
        "simulator.md.j2",
        rep=rep,
        static_tps=static_tps,
        kv_costs=kv_costs,
        pct=_pct,
        ms=_ms,
        knee_png=_knee_png,
    )


def _knee_png(k: dict[str, Any]) -> str:
    return f"sim-knee-{k['model']}-{k['hardware']}.png"


def plot_knees(rep: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in rep["knees"]:
        groups.setdefault((k["model"], k["hardware"]), []).append(k)
    for (model, hw), ks in groups.items():
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for k in ks:
            pts = k["points"]
            off = [p["offered_rps"] for p in pts]
            tput = [p["output_tokens_per_s"] for p in pts]
            style = "-o" if k["mode"] == "continuous" else "--s"
            axes[0].plot(off, tput, style, label=k["mode"])

            def finite(xs: list[Any], cap: float) -> list[float]:
                return [min(float(x), cap) if x not in (None, "inf") else cap for x in xs]

            axes[1].plot(tput, finite([p["ttft_p50_s"] for p in pts], 60), style, label=f"{k['mode']} p50")
            axes[1].plot(
                tput, finite([p["ttft_p99_s"] for p in pts], 60), style, alpha=0.6, label=f"{k['mode']} p99"
            )
            axes[2].plot(tput, [1e3 * (p["itl_p50_s"] or 0) for p in pts], style, label=f"{k['mode']} p50")
            axes[2].plot(
                tput, [1e3 * (p["itl_p99_s"] or 0) for p in pts], style, alpha=0.6, label=f"{k['mode']} p99"
            )
            if k["knee"] and k["mode"] == "continuous":
                axes[0].axvline(k["knee"]["offered_rps"], color="grey", ls=":", label="knee (continuous)")
        axes[0].set(xlabel="offered req/s", ylabel="output tokens/s", title="throughput")
        axes[1].set(xlabel="output tokens/s", ylabel="TTFT s (capped at 60)", yscale="log", title="TTFT")
        axes[1].axhline(rep["workloads"]["reference"]["slo"]["ttft_s"], color="red", ls=":", lw=1)
        axes[2].set(xlabel="output tokens/s", ylabel="ITL ms", title="inter-token latency")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{model} on {ks[0]['tp']}x{hw} (simulated)")
        fig.tight_layout()
        fig.savefig(out_dir / _knee_png(ks[0]), dpi=90)
        plt.close(fig)


# ---- one workload, one configuration (what-if) -----------------------------------------------------------


def what_if(args: argparse.Namespace) -> dict[str, Any]:
    workload = load_workload(args.workload)
    dep = Deployment(MODELS[args.model], HARDWARE[args.gpu], args.tp)
    spec = EngineSpec(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        mode=Batching(args.mode),
        kv_layout=args.kv_layout,
    )
    plan = plan_workload(workload, rate=args.rate)
    slo = _slo(workload)
    out: dict[str, Any] = {"workload": workload.name, "deployment": dep.describe(), "stages": []}
    for stage in plan.stages:
        res = Simulator(dep, spec, replicas=args.replicas).run(
            stage.requests, horizon_s=stage.duration_s + 120
        )
        s = res.summary(slo, stage.duration_s)
        out["stages"].append(
            {
                "stage": stage.name,
                "offered_rps": stage.offered_rate,
                "point": sweep_point(stage.offered_rate, res.records, stage.duration_s, slo),
                "tenants": {k: _brief(v) for k, v in s["stats"]["tenants"].items()},
                "priorities": {k: _brief(v) for k, v in s["stats"]["priorities"].items()},
                "utilization": s["utilization"],
            }
        )
    return _r(out)


def _brief(g: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": g["requests"],
        "ttft_p50_s": g["ttft_s"]["p50"],
        "ttft_p99_s": g["ttft_s"]["p99"],
        "itl_p99_s": g["itl_s"]["p99"],
        "output_tokens_per_s": g["output_tokens_per_s"],
        "goodput_rps": g["goodput_rps"],
    }


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="GPU-scale utilization, knees, KV waste, shared vs dedicated: the real scheduler, simulated",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="where simulator.json/.md and plots go")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer requests, H100 only, no 70B pooling (about a third of the time)",
    )
    p.add_argument("--workload", type=Path, default=None, help="what-if: run this workload file instead")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default="h100")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--mode", choices=[str(m) for m in Batching], default="continuous")
    p.add_argument("--kv-layout", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rate", type=float, default=None, help="what-if: override the workload-wide rate")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    if args.workload is not None:
        print(json.dumps(what_if(args), indent=1, default=str))
        return 0
    cal_path = args.out / "calibration.json"
    calibration = None
    if cal_path.exists():
        cal = json.loads(cal_path.read_text())
        calibration = cal.get("summary")
    report = run_all(args.out, log, quick=args.quick, calibration=calibration)
    print(to_markdown(report))
    return 0
