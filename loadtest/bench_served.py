"""``loom bench served``: the served-system experiments, end to end, in one command.

Each experiment needs a server in a particular configuration (continuous or static batching,
priority classes on or off) and tenants with particular weights and ceilings; done by hand that is a
page of shell (loadtest/README.md). This runs them unattended: for each server configuration it
starts ``loom serve`` (the embedded SmolLM2, one engine replica, its own ``redis-server``, free
loopback ports, as ``loom soak`` does), creates the tenants, runs the workloads of
``loadtest/workloads/`` through the same runner and report as ``loom loadtest``, stops the server,
and finally sets the figures beside the targets in ``results/served.{json,md}`` (each run's own
report, with its plots, in ``results/served/<run>/``).

The client shares the machine's cores with the gateway and the engine; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest import bench_served_peer
from loadtest.generator import plan_workload
from loadtest.loadtest_cli import run_workload
from loadtest.machine import cpu_info, cpu_line
from loadtest.markdown import render
from loadtest.report import write_report
from loadtest.soak_server import SECRET, ServedLoom
from loadtest.static_batching import Batching
from loadtest.workload import Workload, load_workload, parse_workload

WORKLOADS = Path(__file__).parent / "workloads"
RESULTS = Path(__file__).parent / "results"

# Tenant records the workloads name (loadtest/README.md creates the same ones by hand).
TENANTS: dict[str, dict[str, Any]] = {
    "bench": {},
    "chat": {"priority_ceiling": "interactive", "default_priority": "interactive"},
    "bulk": {"priority_ceiling": "batch", "default_priority": "batch"},
    "light": {"weight": 1.0},
    "heavy": {"weight": 3.0},
}


@dataclass(frozen=True)
class Run:
    name: str  # the folder under results/served/
    workload: str  # a file in loadtest/workloads/
    tenants: tuple[str, ...] | None = None  # a subset of the workload's tenants (None: all)


@dataclass(frozen=True)
class Server:
    label: str
    engine_env: dict[str, str] = field(default_factory=dict)
    runs: tuple[Run, ...] = ()


def servers(only: set[str] | None) -> list[Server]:
    def keep(*runs: Run) -> tuple[Run, ...]:
        return tuple(r for r in runs if only is None or r.name in only or r.name.split("-")[0] in only)

    plan = [
        Server(
            "continuous, priority classes on (the default)",
            {},
            keep(
                Run("knee", "knee-embedded.yaml"),
                Run("batching-continuous", "batching.yaml"),
                Run("priority-chat-alone", "priority.yaml", ("chat",)),
                Run("priority-bulk-alone", "priority.yaml", ("bulk",)),
                Run("priority-on", "priority.yaml"),
                Run("fairness", "fairness.yaml"),
            ),
        ),
        Server(
            "continuous, priority classes off",
            {"LOOM_ENGINE_PRIORITY_SCHEDULING": "false"},
            keep(Run("priority-off", "priority.yaml")),
        ),
        Server(
            "static batching",
            {  # the benchmarks' scheduler subclass, imported by the replica from this checkout
                "LOOM_ENGINE_SCHEDULER_CLS": str(Batching.STATIC.scheduler_cls),
                "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
            },
            keep(Run("batching-static", "batching.yaml")),
        ),
    ]
    return [s for s in plan if s.runs]


def _workload(run: Run, served: ServedLoom) -> Workload:
    w = load_workload(WORKLOADS / run.workload)
    data = w.model_dump(mode="json")
    data["target"].update(
        address=served.grpc_address, http_address=served.http_address, metrics_url=served.metrics_url
    )
    if run.tenants is not None:
        data["tenants"] = [t for t in data["tenants"] if t["name"] in run.tenants]
    return parse_workload(data, f"{run.workload} ({run.name})")


def _create_tenants(redis_url: str) -> dict[str, str]:
    from tenancy import RedisTenantStore, TenancySettings
    from tenancy.models import Quotas, Tenant

    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    keys = {}
    for name, fields in TENANTS.items():
        store.create_tenant(Tenant(id=name, quotas=Quotas.unlimited(), **fields), actor="loom-bench-served")
        keys[name] = store.create_key(name, actor="loom-bench-served").plaintext.get_secret_value()
    return keys


async def _serve_and_run(server: Server, out: Path, console: Console) -> dict[str, dict[str, Any]]:
    served = ServedLoom.create(replicas=1, engine_env=server.engine_env, embedded=True)
    reports: dict[str, dict[str, Any]] = {}
    try:
        console.print(f"[bold]server: {server.label}[/bold] (starting)")
        await served.start()
        keys = await asyncio.to_thread(_create_tenants, served.redis_url)
        await asyncio.sleep(2.0)  # the gateway polls the store for new keys every second
        for run in server.runs:
            w = _workload(run, served)
            plan = plan_workload(w)
            console.print(f"  {run.name}: {len(plan.requests)} requests, at most {w.max_seconds:g} s")
            mine = {t.name: keys[t.name] for t in w.tenants}
            report = await run_workload(w, plan, mine, True, console)
            report["options"] = {"server": server.label, "engine_env": server.engine_env, "run": run.name}
            write_report(report, out / run.name)
            reports[run.name] = report
            o = report["stages"][-1]["stats"]["overall"]
            console.print(
                f"    {o['ok']}/{o['requests']} OK, TTFT p99 {o['ttft_s']['p99']} s, "
                f"{o['output_tokens_per_s']:.1f} tok/s"
            )
    finally:
        await served.stop()
        served.remove()
    return reports


# ---- the summary ---------------------------------------------------------------------------------


def _stage(report: dict[str, Any]) -> dict[str, Any]:
    return report["stages"][-1]


def _tenant(report: dict[str, Any], name: str) -> dict[str, Any]:
    return _stage(report)["stats"]["tenants"][name]


def _util(report: dict[str, Any]) -> dict[str, Any]:
    u = _stage(report)["utilization"]
    return u["all"] or next(iter(u["replicas"].values()), {})


def _p99(g: dict[str, Any]) -> float | None:
    v = g["ttft_s"]["p99"]
    return None if v in (None, "inf") else float(v)


def summarize(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if "knee" in reports:
        sweep = reports["knee"]["sweep"]
        s["knee"] = {
            "knee": sweep["knee"],
            "max_sustained": sweep["max_sustained"],
            "points": sweep["points"],
        }
    if {"batching-static", "batching-continuous"} <= reports.keys():
        rows = {}
        for mode in ("static", "continuous"):
            rep = reports[f"batching-{mode}"]
            o, u = _stage(rep)["stats"]["overall"], _util(rep)
            rows[mode] = {
                "output_tokens_per_s": o["output_tokens_per_s"],
                "requests_per_s": o["requests_per_s"],
                "ttft_p50_s": o["ttft_s"]["p50"],
                "ttft_p99_s": o["ttft_s"]["p99"],
                "busy_fraction": u.get("busy_fraction"),
                "slot_occupancy": u.get("slot_occupancy"),
                "useful_token_fraction": u.get("useful_token_fraction"),
            }
        st, co = rows["static"], rows["continuous"]
        rows["continuous_over_static_requests"] = (
            co["requests_per_s"] / st["requests_per_s"] if st["requests_per_s"] else None
        )
        s["batching"] = rows
    if {"priority-chat-alone", "priority-bulk-alone", "priority-on", "priority-off"} <= reports.keys():
        alone = _p99(_tenant(reports["priority-chat-alone"], "chat"))
        on = _p99(_tenant(reports["priority-on"], "chat"))
        off = _p99(_tenant(reports["priority-off"], "chat"))
        step = _util(reports["priority-on"]).get("mean_step_s")
        bulk_alone = _tenant(reports["priority-bulk-alone"], "bulk")["output_tokens_per_s"]
        bulk_on = _tenant(reports["priority-on"], "bulk")["output_tokens_per_s"]
        bulk_off = _tenant(reports["priority-off"], "bulk")["output_tokens_per_s"]
        s["priority"] = {
            "chat_ttft_p99_alone_s": alone,
            "chat_ttft_p99_beside_priority_on_s": on,
            "chat_ttft_p99_beside_priority_off_s": off,
            "flood_mean_step_s": step,
            "on_minus_alone_in_steps": (on - alone) / step
            if None not in (on, alone, step) and step
            else None,
            "on_over_off": on / off if None not in (on, off) and off else None,
            "bulk_tokens_per_s_alone": bulk_alone,
            "bulk_tokens_per_s_beside_on": bulk_on,
            "bulk_tokens_per_s_beside_off": bulk_off,
            "bulk_kept": bulk_on / bulk_alone if bulk_alone else None,
        }
    if "fairness" in reports:
        light = _tenant(reports["fairness"], "light")["output_tokens_per_s"]
        heavy = _tenant(reports["fairness"], "heavy")["output_tokens_per_s"]
        s["fairness"] = {
            "light_tokens_per_s": light,
            "heavy_tokens_per_s": heavy,
            "heavy_over_light": heavy / light if light else None,
        }
    return s


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None or x == "inf" else format(float(x), fmt)


def to_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    return render("served.md.j2", summary=summary, meta=meta, num=_f)


def run_benchmark(out: Path, only: set[str] | None) -> dict[str, Any]:
    console = Console(stderr=True)
    served_dir = out / "served"
    reports: dict[str, dict[str, Any]] = {}
    for server in servers(only):
        reports.update(asyncio.run(_serve_and_run(server, served_dir, console)))
    # A partial run (--only) is summarized with the other experiments' latest reports.
    for server in servers(None):
        for run in server.runs:
            saved = served_dir / run.name / "report.json"
            if run.name not in reports and saved.exists():
                reports[run.name] = json.loads(saved.read_text())
    summary = summarize(reports)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_line(), **cpu_info()}
    result = {"meta": meta, "summary": summary}
    (out / "served.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "served.md").write_text(to_markdown(summary, meta))
    return result


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "served",
        help="the served-system experiments: knee, static vs continuous, priority, fairness (about 40 min)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        action="append",
        choices=("knee", "batching", "batching-static", "batching-continuous", "priority", "fairness"),
        help="run only these experiments or runs (repeatable); the summary reads the others' last reports",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--peer",
        choices=("vllm",),
        help="instead: Loom served against vLLM's OpenAI server, the same streams from one client "
        "(results/served-vs-vllm.md; needs `make peer-vllm`, about 10 min)",
    )
    bench_served_peer.add_arguments(p)
    p.set_defaults(func=lambda args: _main(args))


def _main(args: argparse.Namespace) -> int:
    if args.peer:
        return bench_served_peer.main(args)
    result = run_benchmark(args.out, set(args.only) if args.only else None)
    print(json.dumps(result["summary"], indent=1, default=str)[:4000])
    return 0
