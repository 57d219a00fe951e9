"""Admission benchmark: what one gateway process gets out of the Redis quota script.

    python -m loadtest.bench_admission [--redis-url URL] [--requests 20000] [--cpu 0]

Measures, from ONE asyncio process pinned to ONE core, against the local Redis:

* ``admit`` one at a time (concurrency 1): the latency a single request sees;
* ``admit`` with 8/32/64 requests in flight (asyncio tasks over a connection pool), which is how a
  gateway serving many streams calls it: throughput and latency including client-side queueing;
* ``admit + finish`` (two script calls per request: the full quota cost of one request);
* the in-process limiter (embedded store / fail-static) and ``authenticate`` (HMAC, no I/O) for scale.

Every admission runs the full script: the tenant has every limit set (requests/min, tokens/min,
concurrency, daily and monthly budgets), set high enough that all are granted, so each call does the
complete check-and-reserve path. Latency is ``perf_counter`` around each awaited call. Results go to
``loadtest/results/admission.json`` and ``admission.md`` (machine details and versions included).
This is a benchmark, not a test: numbers on a shared 2-core machine are noisy; compare runs, not
absolute values from different machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from loadtest.markdown import render
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.directory import TenantCatalog, TenantDirectory, TenantEntry
from tenancy.keys import KeyHasher
from tenancy.models import Quotas, Tenant
from tenancy.settings import TenancySettings

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_P50_MS = 1.0
TARGET_RATE = 2000.0


def bench_tenant() -> Tenant:
    big = 10**12
    return Tenant(
        id="bench",
        quotas=Quotas(
            requests_per_minute=10**9,
            tokens_per_minute=big,
            max_concurrent=10**7,
            max_tokens_per_request=256,
            max_prompt_tokens=512,
            daily_token_budget=big,
            monthly_token_budget=big,
        ),
    )


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


async def run_load(
    name: str, op: Callable[[int], Awaitable[Any]], total: int, concurrency: int
) -> dict[str, Any]:
    """``total`` calls of ``op(i)`` with ``concurrency`` in flight; per-call latency and overall rate."""
    latencies: list[float] = []
    counter = iter(range(total))

    async def worker() -> None:
        perf = time.perf_counter
        for i in counter:
            t0 = perf()
            await op(i)
            latencies.append(perf() - t0)

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    latencies.sort()
    return {
        "workload": name,
        "concurrency": concurrency,
        "calls": total,
        "per_second": total / elapsed,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "client_cpu_us_per_call": cpu / total * 1e6,
    }


def server_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
        return {"redis_version": info.get("redis_version"), "redis_mode": info.get("redis_mode")}
    finally:
        client.close()


def versions() -> dict[str, Any]:
    def version_of(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "redis_py": version_of("redis"),
        "hiredis": version_of("hiredis"),
        "pydantic": version_of("pydantic"),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpus_online": os.cpu_count(),
        "event_loop": type(asyncio.get_event_loop_policy()).__name__,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"loombench-{uuid.uuid4().hex[:8]}"
    settings = TenancySettings(
        store="redis",
        redis_url=args.redis_url,
        key_prefix=prefix,
        secret="bench-secret-0123456789abcdef",
        redis_timeout_s=2.0,  # measure the script, not a timeout on a noisy shared machine
        redis_max_connections=256,
    )
    tenant = bench_tenant()
    enforcer = RedisAdmission.from_settings(settings)
    results: list[dict[str, Any]] = []
    run_id = uuid.uuid4().hex[:6]
    n = args.requests
    try:
        # warm-up: connections, script load, code paths
        for i in range(500):
            await enforcer.admit(tenant, f"warm-{run_id}-{i}", 100, 100)

        for concurrency in args.concurrency:
            tag = f"{run_id}-a{concurrency}"

            async def admit(i: int, tag: str = tag) -> None:
                a = await enforcer.admit(tenant, f"{tag}-{i}", 100, 100)
                assert a.granted and a.backend.value == "redis", a

            results.append(await run_load("redis admit", admit, n, concurrency))
            print(_line(results[-1]), file=sys.stderr)
            await _clear_leases(enforcer, prefix, tenant.id)

        for concurrency in args.concurrency:
            tag = f"{run_id}-f{concurrency}"

            async def admit_finish(i: int, tag: str = tag) -> None:
                rid = f"{tag}-{i}"
                a = await enforcer.admit(tenant, rid, 100, 100)
                assert a.granted, a
                await enforcer.finish(tenant, rid, 50, prompt_tokens=100)

            results.append(await run_load("redis admit+finish", admit_finish, n // 2, concurrency))
            print(_line(results[-1]), file=sys.stderr)
    finally:
        await enforcer.close()
        client = redis.Redis.from_url(args.redis_url)
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
        client.close()

    local = LocalAdmission()

    async def local_admit(i: int) -> None:
        await local.admit(tenant, f"l-{i}", 100, 100)

    results.append(await run_load("in-process admit (embedded/fail-static)", local_admit, n, 1))
    print(_line(results[-1]), file=sys.stderr)

    hasher = KeyHasher(b"bench-secret-0123456789abcdef")
    issued = hasher.issue(tenant.id)
    directory = TenantDirectory(hasher, TenantCatalog.build([TenantEntry(tenant, (issued.record,))]))
    token = f"Bearer {issued.plaintext.get_secret_value()}"

    async def authenticate(i: int) -> None:
        directory.authenticate(token)

    results.append(await run_load("authenticate (cached, HMAC)", authenticate, n, 1))
    print(_line(results[-1]), file=sys.stderr)
    return {"results": results}


async def _clear_leases(enforcer: RedisAdmission, prefix: str, tenant_id: str) -> None:
    """Drop the leases the admit-only runs left, so each run starts from the same state."""
    await enforcer._client.delete(f"{prefix}:t:{{{tenant_id}}}:leases")


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['workload']:<42} c={r['concurrency']:<3} {r['per_second']:>10,.0f}/s  "
        f"p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  cpu {r['client_cpu_us_per_call']:.0f} us/call"
    )


def markdown(report: dict[str, Any]) -> str:
    return render("admission.md.j2", report=report, target_p50_ms=TARGET_P50_MS, target_rate=TARGET_RATE)


def run(args: argparse.Namespace) -> int:
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "workload": {
            "description": (
                f"{args.requests} admissions per row against one tenant with every limit set "
                "(all granted: full check-and-reserve path), prompt 100 + max_tokens 100 tokens; "
                "admit+finish rows run half as many requests."
            ),
            "requests": args.requests,
            "concurrency": args.concurrency,
            "client_cpu": args.cpu,
        },
        "versions": versions(),
        "server": server_info(args.redis_url),
        "load_average_before": os.getloadavg(),
    }
    report.update(asyncio.run(bench(args)))
    report["load_average_after"] = os.getloadavg()
    c1 = [r for r in report["results"] if r["workload"] == "redis admit" and r["concurrency"] == 1]
    best = max(r["per_second"] for r in report["results"] if r["workload"] == "redis admit")
    p50 = c1[0]["p50_ms"] if c1 else float("nan")
    report["targets"] = {
        "p50_ms_at_c1": p50,
        "best_admissions_per_s": best,
        "met": bool(p50 < TARGET_P50_MS and best >= TARGET_RATE),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "admission.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "admission.md").write_text(markdown(report))
    print(f"wrote {out / 'admission.json'} and {out / 'admission.md'}", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--requests", type=int, default=20_000, help="calls per row")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--cpu", type=int, default=0, help="pin the client to this CPU (-1: no pinning)")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))


def register(sub: argparse._SubParsersAction) -> None:
    """For ``loom bench admission`` (loom/cmd_bench.py may add it next to the engine benchmark)."""
    p = sub.add_parser("admission", help="quota admission throughput and latency against Redis")
    add_arguments(p)
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    if args.cpu is not None and args.cpu < 0:
        args.cpu = None
    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_admission", description=__doc__)
    add_arguments(parser)
    return _run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
