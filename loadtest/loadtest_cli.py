"""``loom loadtest WORKLOAD.yaml``: open-loop multi-tenant load against a running Loom, with a report.

The workload file says everything (loadtest/workloads/*.yaml); flags override the few things that
change from run to run (address, keys, rate, duration, caps, output folder). Exit status: 0 when
the run completed (whatever the server answered: refusals are results), 2 for a bad workload or
flag, 3 when not a single request succeeded (the target is probably not there).

``--front grpc|http`` sends every tenant through one front (else each tenant's ``front``, else the
workload's); ``--copy-bandwidth-gbs`` gives the report's MBU (else GB/s moved only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest.driver import (
    Driver,
    GrpcDriver,
    HttpDriver,
    NotLoopbackError,
    PerTenantDriver,
    require_loopback,
    require_loopback_url,
)
from loadtest.generator import plan_workload
from loadtest.prometheus import MetricsSampler
from loadtest.report import build_report, write_report
from loadtest.runner import Runner, describe_plan
from loadtest.workload import Workload, WorkloadError, load_workload, parse_workload

RUNS_DIR = Path(__file__).parent / "results" / "runs"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loadtest",
        help="open-loop multi-tenant load against a running Loom on this machine, with a report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workload", type=Path, help="a workload file (see loadtest/workloads/)")
    p.add_argument("--address", default=None, help="host:port of the gateway's gRPC (loopback only)")
    p.add_argument(
        "--http-address", default=None, help="host:port of the gateway's HTTP front (loopback only)"
    )
    p.add_argument(
        "--front",
        choices=("grpc", "http"),
        default=None,
        help="send every tenant's requests through this front (overrides the workload's front fields)",
    )
    p.add_argument(
        "--copy-bandwidth-gbs",
        type=float,
        default=None,
        help="the serving device's measured copy bandwidth (GB/s, bytes read + written): gives MBU; "
        "without it the report gives the GB/s the steps moved and leaves MBU empty",
    )
    p.add_argument(
        "--api-key", action="append", default=[], metavar="TENANT=KEY", help="a tenant's key (repeatable)"
    )
    p.add_argument("--metrics-url", default=None, help="the gateway's Prometheus endpoint; 'none' to skip")
    p.add_argument("--model", default=None, help="the model to ask for")
    p.add_argument(
        "--rate", type=float, default=None, help="override the workload-wide Poisson/constant rate"
    )
    p.add_argument("--duration", type=float, default=None, help="arrival window in seconds (per stage)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None, help="hard wall-clock cap, draining included")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help=f"report folder (default {RUNS_DIR}/NAME-TIME)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument("--dry-run", action="store_true", help="print the plan and send nothing")
    p.set_defaults(func=main)


def _overrides(w: Workload, args: argparse.Namespace, source: str) -> Workload:
    """The workload with the command line's overrides, validated again as if the file said them."""
    data = w.model_dump(mode="json")
    if args.address:
        data["target"]["address"] = args.address
    if args.http_address:
        data["target"]["http_address"] = args.http_address
    if args.front:
        data["front"] = args.front
        for tenant in data["tenants"]:
            tenant["front"] = None
    if args.model:
        data["target"]["model"] = args.model
    if args.metrics_url:
        data["target"]["metrics_url"] = None if args.metrics_url.lower() == "none" else args.metrics_url
    for flag, name in (
        ("seed", "seed"),
        ("duration", "duration_s"),
        ("max_requests", "max_requests"),
        ("max_seconds", "max_seconds"),
    ):
        if getattr(args, flag) is not None:
            data[name] = getattr(args, flag)
    return parse_workload(data, f"{source} (with command-line overrides)")


def _parse_keys(pairs: list[str]) -> dict[str, str]:
    keys = {}
    for pair in pairs:
        tenant, sep, key = pair.partition("=")
        if not sep or not tenant or not key:
            raise WorkloadError(f"--api-key wants TENANT=KEY, got {pair!r}")
        keys[tenant] = key
    return keys


def main(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        w = _overrides(load_workload(args.workload), args, str(args.workload))
        fronts = set(w.fronts.values())
        if "grpc" in fronts:
            require_loopback(w.target.address)
        if "http" in fronts:
            require_loopback(w.target.http_address)
        if args.copy_bandwidth_gbs is not None and args.copy_bandwidth_gbs <= 0:
            raise ValueError("--copy-bandwidth-gbs must be positive")
        if w.target.metrics_url:
            require_loopback_url(w.target.metrics_url)
        plan = plan_workload(w, rate=args.rate, duration_s=args.duration)
        if args.dry_run:
            print(json.dumps(describe_plan(plan), indent=1))
            return 0
        keys = w.resolve_keys(_parse_keys(args.api_key))
    except (WorkloadError, NotLoopbackError, ValueError) as exc:
        err.print(f"[red]loom loadtest:[/red] {exc}", highlight=False)
        return 2
    out = args.out or RUNS_DIR / f"{w.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    err.print(
        f"{w.name}: {len(plan.requests)} requests in {len(plan.stages)} stage(s) to {_where(w)}, "
        f"at most {w.max_seconds:g} s; report in {out}",
        highlight=False,
    )
    report = asyncio.run(run_workload(w, plan, keys, args.quiet, err, args.copy_bandwidth_gbs))
    report["options"] = {
        "address": w.target.address,
        "http_address": w.target.http_address,
        "fronts": w.fronts,
        "copy_bandwidth_gbs": args.copy_bandwidth_gbs,
        "rate": args.rate,
        "argv": sys.argv[1:] if sys.argv else [],
    }
    for path in write_report(report, out, plots=not args.no_plots):
        err.print(f"wrote {path}", highlight=False)
    overall = [s["stats"]["overall"] for s in report["stages"]]
    ok = sum(o["ok"] for o in overall)
    for s in report["stages"]:
        o = s["stats"]["overall"]
        err.print(
            f"stage {s['name']}: {o['ok']}/{o['requests']} OK, codes {o['codes']}, TTFT p50/p99 "
            f"{o['ttft_s']['p50']} / {o['ttft_s']['p99']} s, {o['output_tokens_per_s']:.1f} tok/s, "
            f"goodput {o['goodput_rps']:.2f} req/s",
            highlight=False,
        )
    return 0 if ok else 3


def _where(w: Workload) -> str:
    fronts = set(w.fronts.values())
    where = {"grpc": w.target.address, "http": w.target.http_address}
    return ", ".join(f"{where[f]} ({f})" for f in sorted(fronts))


def _driver(w: Workload, keys: dict[str, str]) -> Driver:
    """One driver per front in use, each with the keys of the tenants it serves."""
    fronts = w.fronts
    drivers: dict[str, Driver] = {}
    for front in sorted(set(fronts.values())):
        mine = {t: k for t, k in keys.items() if fronts[t] == front}
        if front == "http":
            drivers[front] = HttpDriver(w.target.http_address, mine)
        else:
            drivers[front] = GrpcDriver(w.target.address, mine)
    if len(drivers) == 1:
        return next(iter(drivers.values()))
    return PerTenantDriver(drivers, fronts)


async def run_workload(
    w: Workload,
    plan: Any,
    keys: dict[str, str],
    quiet: bool,
    console: Console,
    copy_bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    driver = _driver(w, keys)
    sampler = MetricsSampler(w.target.metrics_url) if w.target.metrics_url else None
    try:
        runner = Runner(w, plan, driver, sampler=sampler, console=console, live=not quiet)
        result = await runner.run()
    finally:
        await driver.close()
    report = build_report(w, plan, result, {"address": w.target.address}, copy_bandwidth_gbs)
    # HTTP streams whose chunks came without log-probabilities had their tokens counted from text.
    drivers = driver.drivers.values() if isinstance(driver, PerTenantDriver) else [driver]
    report["approximate_streams"] = sum(d.approximate_streams for d in drivers if isinstance(d, HttpDriver))
    return report
