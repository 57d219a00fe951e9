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


def _lat(s: dict[str, Any]) -> str:
    return f"{_ms(s['p50'])} / {_ms(s['p90'])} / {_ms(s['p99'])}"


def _group_table(groups: dict[str, dict[str, Any]], label: str) -> list[str]:
    lines = [
        f"| {label} | requests | OK | codes | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 | E2E ms p50/p90/p99 "
        "| out tok/s | req/s | goodput req/s (share) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, g in groups.items():
        codes = ", ".join(f"{k} {v}" for k, v in g["codes"].items() if k != "OK") or "-"
        lines.append(
            f"| {name} | {g['requests']} | {g['ok']} | {codes} | {_lat(g['ttft_s'])} | {_lat(g['itl_s'])} "
            f"| {_lat(g['e2e_s'])} | {g['output_tokens_per_s']:.1f} | {g['requests_per_s']:.2f} "
            f"| {g['goodput_rps']:.2f} ({g['goodput_fraction']:.0%}) |"
        )
    return lines


def to_markdown(rep: dict[str, Any]) -> str:
    w = rep["workload"]
    slo = w["slo"]
    L = [
        f"# Load test `{w['name']}` (run {rep['run_id']})",
        "",
        f"{rep['date']}; target {_targets(rep)}, model "
        f"`{w['target']['model']}`; {rep['plan']['requests']} requests planned (seed {w['seed']}"
        f"{', truncated by max_requests' if rep['plan']['truncated_by_max_requests'] else ''}), "
        f"wall {rep['wall_s']:.1f} s. SLO: TTFT <= {slo['ttft_s'] * 1e3:.0f} ms and mean ITL (TPOT) <= "
        f"{slo['itl_s'] * 1e3:.0f} ms. TTFT counts from the planned arrival (open loop); ITL is the gap "
        "between streamed chunks; throughput counts what arrived inside each stage's arrival window.",
    ]
    if w.get("description"):
        L += ["", w["description"]]
    if rep["skipped_stages"]:
        L += ["", f"Not run (max_seconds reached): {', '.join(rep['skipped_stages'])}."]
    sweep = rep.get("sweep")
    if sweep:
        knee, top = sweep["knee"], sweep["max_sustained"]
        L += [
            "",
            "## Rate sweep",
            "",
            "| offered req/s | started req/s | completed req/s | out tok/s | TTFT p50 / p99 ms "
            "| ITL p50 / p99 ms "
            "| goodput req/s | refused |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in sweep["points"]:
            L.append(
                f"| {p['offered_rps']:.2f} | {p['started_rps']:.2f} | {p['achieved_rps']:.2f} "
                f"| {p['output_tokens_per_s']:.1f} | {_ms(p['ttft_p50_s'])} / {_ms(p['ttft_p99_s'])} "
                f"| {_ms(p['itl_p50_s'])} / {_ms(p['itl_p99_s'])} | {p['goodput_rps']:.2f} | {p['refused']} |"
            )
        knee_text = (
            f"Knee (highest rate kept up with, p99 TTFT within the SLO): **{knee['offered_rps']:.2f} req/s**"
            if knee
            else "Knee: none (p99 TTFT over the SLO at every rate)"
        )
        top_text = f"; highest rate kept up with at all: {top['offered_rps']:.2f} req/s." if top else "."
        L += ["", knee_text + top_text, "", "![knee](knee.png)"]
    for st in rep["stages"]:
        s = st["stats"]
        title = "Results" if len(rep["stages"]) == 1 else f"Stage {st['name']}"
        L += ["", f"## {title}", ""]
        L += _group_table({"all": s["overall"]}, "group")
        L += ["", *_group_table(s["tenants"], "tenant")]
        L += ["", *_group_table(s["priorities"], "priority (requested)")]
        if len(s["tenant_priority"]) > len(s["tenants"]):
            L += ["", *_group_table(s["tenant_priority"], "tenant/priority")]
        if s.get("fronts"):
            L += ["", *_group_table(s["fronts"], "front")]
        lag = s["overall"]["send_lag_s"]
        if lag["n"]:
            L += [
                "",
                f"Client send lag (actual - planned send time): p50 {_ms(lag['p50'])} ms, "
                f"p99 {_ms(lag['p99'])} ms"
                " (large values mean the client, not the server, was the bottleneck).",
            ]
        if st["engine"]:
            L += [
                "",
                "Engine gauges over the window (from the gateway's /metrics), mean / max:",
                "",
                "| replica | running | waiting | KV cache used | step-busy fraction |",
                "|---|---:|---:|---:|---:|",
            ]
            for replica, g in st["engine"].items():

                def mm(name: str, pct: bool = False, g: dict[str, Any] = g) -> str:
                    v = g.get(name)
                    if not v:
                        return "-"
                    if pct:
                        return f"{v['mean']:.0%} / {v['max']:.0%}"
                    return f"{v['mean']:.1f} / {v['max']:.0f}"

                L.append(
                    f"| {replica} | {mm('num_requests_running')} | {mm('num_requests_waiting')} "
                    f"| {mm('kv_cache_usage_perc', True)} | {mm('engine_busy_fraction', True)} |"
                )
        if st.get("utilization") is not None:
            L += _utilization_table(st["utilization"], m_url=rep["metrics"]["url"])
    m = rep["metrics"]
    if m["url"]:
        L += ["", f"Metrics: {m['samples']} scrapes of {m['url']}, {m['failed_scrapes']} failed."]
    L += ["", "![latency over time](latency.png)"]
    return "\n".join(L) + "\n"


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


def _utilization_table(u: dict[str, Any], m_url: str | None) -> list[str]:
    if not m_url:
        return []
    rows = dict(u["replicas"])
    if u.get("all"):
        rows["all replicas"] = u["all"]
    L = [""]
    if not rows:
        return [
            "",
            "Utilization: no replica had two scrapes of the engine counters inside the window "
            "(the gateway may predate them, or the window is shorter than the scrape interval).",
        ]
    bw = u.get("copy_bandwidth_gbs")
    L += [
        "Utilization over the window, from the replicas' counters (docs/utilization.md): step-busy = "
        "step seconds / wall seconds; slot occupancy = live-sequence step seconds / (step seconds x "
        "batch capacity); useful tokens = 1 - (padding + recomputed) / computed; KV = blocks in use / "
        "blocks, mean / max over the scrapes; GB/s = bytes the steps moved (weights + K/V read and "
        "written) per wall second and per second of step time.",
        "",
        "| replica | window s | step-busy | slot occupancy | useful tokens | KV blocks in use "
        "| steps/s | mean step ms | GB/s wall / in steps | MBU in steps / wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in rows.items():
        mbu = f"{_pct(f['mbu'])} / {_pct(f['mbu_wall'])}" if f.get("mbu") is not None else "-"
        step_ms = f"{f['mean_step_s'] * 1e3:.1f}" if f.get("mean_step_s") is not None else "-"
        busy_gbs = f"{f['gb_per_s_busy']:.2f}" if f.get("gb_per_s_busy") is not None else "-"
        restarts = (
            f" ({f['restarts']} restart{'s' if f['restarts'] != 1 else ''})" if f.get("restarts") else ""
        )
        L.append(
            f"| {name}{restarts} | {f['wall_s']:.1f} | {_pct(f['busy_fraction'])} "
            f"| {_pct(f['slot_occupancy'])} | {_pct(f['useful_token_fraction'])} "
            f"| {_pct(f['kv_blocks_in_use'])} / "
            f"{_pct(f['kv_blocks_in_use_max'])} | {f['steps_per_s']:.1f} | {step_ms} "
            f"| {f['gb_per_s_wall']:.2f} / {busy_gbs} | {mbu} |"
        )
    if bw:
        L += [
            "",
            f"MBU = bytes moved per second of step time / the copy bandwidth given ({bw:g} GB/s, "
            "--copy-bandwidth-gbs); 'wall' divides by wall time instead.",
        ]
    else:
        L += [
            "",
            "MBU is left empty: no copy bandwidth was given (--copy-bandwidth-gbs, measured on the "
            "serving machine); the bytes moved are reported in GB/s instead.",
        ]
    if u.get("skipped"):
        L += ["", f"Fewer than two scrapes in the window, not reported: {', '.join(u['skipped'])}."]
    return L


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
