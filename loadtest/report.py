"""The load test's report: ``report.json`` (everything, per request too), ``report.md`` (the tables a
reader wants) and PNG plots (latency over time with the engine gauges under it; for a sweep, the knee).

Per stage and per replica it also gives the utilization figures of docs/utilization.md, computed
from the engines' counters over the stage's window (loadtest.prometheus.utilization): step-busy
fraction, slot occupancy, useful-token fraction, KV blocks in use, GB/s moved and, when the copy
bandwidth was measured and given (``--copy-bandwidth-gbs``), MBU.

Everything is computed from the run's records by the plain functions of loadtest.stats, so the
report of a run can be rebuilt from its JSON and the same numbers come out.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from typing import Any

from loadtest.generator import Plan
from loadtest.markdown import render
from loadtest.prometheus import series, summarize_samples, utilization, utilization_series
from loadtest.runner import RunResult, describe_plan, records_of, stage_window
from loadtest.stats import SloSpec, find_knee, grouped, sweep_point, timeline
from loadtest.workload import Workload


def _clean(x: Any) -> Any:
    """JSON-safe: infinities as the string "inf", floats rounded to microseconds."""
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        if math.isnan(x):
            return None
        return round(x, 6)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def build_report(
    workload: Workload,
    plan: Plan,
    result: RunResult,
    options: dict[str, Any],
    copy_bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    slo = SloSpec(workload.slo.ttft_s, workload.slo.itl_s)
    samples = result.metrics.samples if result.metrics is not None else []
    stages = []
    for st in result.stages:
        window = stage_window(st)
        stages.append(
            {
                "name": st.stage.name,
                "offered_rps": st.stage.offered_rate,
                "window_s": window,
                "started_s": st.started_s,
                "ended_s": st.ended_s,
                "cut_short": st.cut_short,
                "point": sweep_point(st.stage.offered_rate, st.records, window, slo),
                "stats": grouped(st.records, window, slo),
                "engine": summarize_samples(samples, st.started_s, st.started_s + window),
                "utilization": utilization(samples, st.started_s, st.started_s + window, copy_bandwidth_gbs),
                "timeline": timeline(
                    st.records, max(0.5, window / 60), max(window, st.ended_s - st.started_s)
                ),
            }
        )
    report: dict[str, Any] = {
        "workload": workload.model_dump(mode="json", exclude={"tenants": {"__all__": {"api_key"}}}),
        "options": options,
        "run_id": result.run_id,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": result.wall_s,
        "plan": describe_plan(plan),
        "skipped_stages": result.skipped_stages,
        "stages": stages,
        "metrics": {
            "url": result.metrics.url if result.metrics is not None else None,
            "samples": len(samples),
            "failed_scrapes": result.metrics.errors if result.metrics is not None else 0,
            "last_error": result.metrics.last_error if result.metrics is not None else None,
            "series": series(samples),
            "utilization_series": utilization_series(samples),
        },
        "copy_bandwidth_gbs": copy_bandwidth_gbs,
        "versions": {"python": platform.python_version()},
        "requests": [r.to_dict() for r in records_of(result)],
    }
    if workload.is_sweep:
        points = [s["point"] for s in stages]
        report["sweep"] = {
            "points": points,
            "knee": find_knee(points, workload.slo.ttft_s),
            "max_sustained": find_knee(points, math.inf),
        }
    return _clean(report)


# ---- Markdown --------------------------------------------------------------------------------------


def _ms(x: Any) -> str:
    if x is None:
        return "-"
    if x == "inf":
        return "inf"
    return f"{float(x) * 1e3:.0f}"


def to_markdown(rep: dict[str, Any]) -> str:
    return render(
        "report.md.j2",
        rep=rep,
        targets=_targets(rep),
        ms=_ms,
        pct=_pct,
        utilization_rows=_utilization_rows,
    )


def _targets(rep: dict[str, Any]) -> str:
    """Where the load went: each front used and its address."""
    w = rep["workload"]
    fronts = sorted({t.get("front") or w.get("front", "grpc") for t in w["tenants"]})
    opts = rep["options"]
    where = {
        "grpc": opts.get("address") or w["target"]["address"],
        "http": opts.get("http_address") or w["target"].get("http_address"),
    }
    return ", ".join(f"{where.get(f)} ({f})" for f in fronts)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1%}"


def _utilization_rows(u: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each replica's utilization figures and, where there are, all replicas' together."""
    return dict(u["replicas"]) | ({"all replicas": u["all"]} if u.get("all") else {})


# ---- plots -----------------------------------------------------------------------------------------


def plot(rep: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = {"interactive": "tab:red", "standard": "tab:blue", "batch": "tab:green"}
    engine = rep["metrics"]["series"]
    rows = 3 if engine else 2
    fig, axes = plt.subplots(rows, 1, figsize=(11, 3.0 * rows), sharex=True)
    offsets = {i: st["started_s"] for i, st in enumerate(rep["stages"])}
    for prio, color in colors.items():
        xs, ys = [], []
        for r in rep["requests"]:
            if r["priority"] == prio and r["ttft_s"] not in (None, "inf"):
                xs.append(offsets.get(r["stage"], 0.0) + r["scheduled_s"])
                ys.append(r["ttft_s"])
        if xs:
            axes[0].scatter(xs, ys, s=6, color=color, label=f"{prio} TTFT", alpha=0.6)
    axes[0].axhline(rep["workload"]["slo"]["ttft_s"], color="grey", ls=":", lw=1, label="SLO")
    axes[0].set(ylabel="TTFT s (by planned arrival)", yscale="log")
    axes[0].legend(fontsize=7, loc="upper left")
    for st in rep["stages"]:
        tl = st["timeline"]
        axes[1].plot([st["started_s"] + t for t in tl["t_s"]], tl["output_tokens_per_s"], color="tab:purple")
    axes[1].set(ylabel="output tokens/s", ylim=(0, None))
    if engine:
        ax = axes[2]
        ax2 = ax.twinx()
        for replica, gauges in engine.items():
            for name, (ts, vs) in gauges.items():
                if name in ("num_requests_running", "num_requests_waiting"):
                    ax.plot(ts, vs, label=f"{replica} {name.removeprefix('num_requests_')}")
                elif name != "engine_busy_fraction" or not rep["metrics"].get("utilization_series"):
                    ax2.plot(ts, vs, ls="--", label=f"{replica} {name}")
        for replica, figs in (rep["metrics"].get("utilization_series") or {}).items():
            for name, (ts, vs) in figs.items():
                if ts:
                    ax2.plot(ts, vs, ls=":", label=f"{replica} {name.replace('_', ' ')}")
        top = max(
            (max(vs) for g in engine.values() for n, (_, vs) in g.items() if n.startswith("num_")), default=0
        )
        ax.set(ylabel="requests", ylim=(0, max(1.0, 1.1 * top)))
        ax2.set(ylabel="fraction", ylim=(0, 1.05))
        ax.legend(fontsize=7, loc="upper left")
        ax2.legend(fontsize=7, loc="upper right")
    axes[-1].set(xlabel="seconds since the start of the run")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(f"{rep['workload']['name']}: latency and engine state over time")
    fig.tight_layout()
    path = out_dir / "latency.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
    sweep = rep.get("sweep")
    if sweep:
        pts = sweep["points"]

        def val(x: Any, cap: float = 300.0) -> float:
            return cap if x in (None, "inf") else min(float(x), cap)

        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        off = [p["offered_rps"] for p in pts]
        tput = [p["output_tokens_per_s"] for p in pts]
        axes[0].plot(off, [p["started_rps"] for p in pts], "-o", label="started req/s")
        axes[0].plot(off, off, ":", color="grey", label="offered")
        axes[0].set(xlabel="offered req/s", ylabel="req/s", title="throughput")
        axes[1].plot(tput, [val(p["ttft_p50_s"]) for p in pts], "-o", label="p50")
        axes[1].plot(tput, [val(p["ttft_p99_s"]) for p in pts], "-s", label="p99")
        axes[1].axhline(rep["workload"]["slo"]["ttft_s"], color="red", ls=":", lw=1, label="SLO")
        axes[1].set(xlabel="output tokens/s", ylabel="TTFT s", yscale="log", title="TTFT")
        axes[2].plot(tput, [1e3 * val(p["itl_p50_s"]) for p in pts], "-o", label="p50")
        axes[2].plot(tput, [1e3 * val(p["itl_p99_s"]) for p in pts], "-s", label="p99")
        axes[2].set(xlabel="output tokens/s", ylabel="ITL ms", title="inter-token latency")
        if sweep["knee"]:
            axes[0].axvline(sweep["knee"]["offered_rps"], color="grey", ls="--", label="knee")
        for a in axes:
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.suptitle(f"{rep['workload']['name']}: rate sweep")
        fig.tight_layout()
        path = out_dir / "knee.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def write_report(rep: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(rep, indent=1) + "\n")
    paths[1].write_text(to_markdown(rep))
    if plots:
        paths += plot(rep, out_dir)
    return paths
