"""``loom bench stream-cost``: what a streamed output token costs each process of a served Loom.

Issue 22's first measurement. A ``loom serve`` (one replica of the embedded model, float32,
``max_num_seqs`` 64, its own Redis) gets ``--requests`` seeded greedy chat streams at once through
the official ``openai`` SDK on the HTTP front, after a short warm-up. Around that window the CPU time
(user + system, from ``/proc``) of every process is read and grouped: the gateway (``loom serve``
itself, or its Serve replicas with ``--gateways``), each engine replica split by thread into the
engine loop with torch's OpenMP workers (the threads named ``loom-engine``) and the rest (its event
loop, Ray's core threads), the Serve controller, the rest of Ray, and the client (this process).
A quiet window before the load gives each group's idle CPU per second, so the cost that grows with
tokens can be told from Serve's and Ray's periodic work.
Each group's CPU seconds divided by the output tokens streamed is the figure the issue's targets
are stated in (gateway <= 0.15 ms, replica outside the engine step <= 0.1 ms per token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.machine import cpu_info, cpu_line
from loadtest.markdown import render, write_report
from loadtest.profiles import recording, summarise
from loadtest.soak_server import SECRET, ServedLoom, cmdline, descendants

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ENGINE_THREAD = "loom-engine"  # the OS name AsyncEngine gives its loop thread
IDLE_WINDOW_S = 5.0
_TICK = os.sysconf("SC_CLK_TCK")
TOPICS = ["weaving", "rivers", "bread", "winter", "bees", "lighthouses", "tea", "maps", "clocks", "owls"]


@dataclass(frozen=True)
class ThreadCpu:
    pid: int
    tid: int
    name: str
    cpu_s: float


def _stat_cpu(path: str) -> tuple[str, float] | None:
    """(comm, user + system seconds) of a /proc stat file; None if it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def threads_of(pid: int) -> list[ThreadCpu]:
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        got = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        if got is not None:
            out.append(ThreadCpu(pid, int(tid), got[0], got[1]))
    return out


def role(pid: int, serve_pid: int, client_pid: int) -> str:
    """The group of a process: ``serve_pid`` is ``loom serve``, the gateway unless gateways run as
    Serve replicas (then it only waits, and counts as ``driver``)."""
    if pid == client_pid:
        return "client"
    cmd = cmdline(pid)
    if pid == serve_pid:
        return "driver" if "--gateway-in-serve" in cmd else "gateway"
    if "ServeReplica" in cmd and ":gateway" in cmd:
        return "gateway"
    if "ServeReplica" in cmd and "engine-" in cmd:
        return "replica"
    if "ServeController" in cmd:
        return "serve_controller"
    if "redis-server" in cmd:
        return "redis"
    return "ray_other"


Snapshot = dict[tuple[int, int], tuple[str, str, float]]  # (pid, tid) -> (role, thread name, CPU s)


def snapshot(serve_pid: int, client_pid: int) -> Snapshot:
    """Every thread of the whole served tree and of this client, with its CPU seconds so far."""
    snap = {}
    for pid in [serve_pid, client_pid, *descendants(serve_pid)]:
        r = role(pid, serve_pid, client_pid)
        for t in threads_of(pid):
            snap[(pid, t.tid)] = (r, t.name, t.cpu_s)
    return snap


def _spent(before: Snapshot, after: Snapshot) -> list[tuple[str, str, float]]:
    """(role, thread name, CPU seconds spent between the snapshots) of each thread alive at the
    second; one started in between counts from zero, one that ended is not seen."""
    return [
        (r, name, cpu - (before[key][2] if key in before else 0.0)) for key, (r, name, cpu) in after.items()
    ]


def busiest_threads(before: Snapshot, after: Snapshot, of_role: str) -> list[dict[str, Any]]:
    """A role's threads by CPU spent in the window: how a replica's split was made, and how much of
    the gateway's CPU is Ray's native threads (which py-spy does not see) rather than its loop."""
    rows = [{"name": name, "cpu_s": round(cpu, 3)} for r, name, cpu in _spent(before, after) if r == of_role]
    return sorted(rows, key=lambda row: -row["cpu_s"])[:12]


def cpu_by_group(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds spent between two snapshots per group; a replica's threads split into its engine
    loop thread and the rest."""
    groups: dict[str, float] = {}
    for r, name, spent in _spent(before, after):
        group = r
        if r == "replica":
            group = "replica_engine_thread" if name == ENGINE_THREAD else "replica_rest"
        groups[group] = groups.get(group, 0.0) + spent
    return groups


def per_token(groups: dict[str, float], tokens: int) -> dict[str, dict[str, float]]:
    return {
        g: {"cpu_s": round(s, 3), "ms_per_output_token": round(1e3 * s / tokens, 4) if tokens else 0.0}
        for g, s in sorted(groups.items())
    }


def workload(n: int, seed: int) -> list[tuple[str, int]]:
    """Seeded chat prompts and output lengths (lognormal around 28 tokens, in [4, 96])."""
    rng = random.Random(seed)
    return [
        (
            f"Write a short note about {rng.choice(TOPICS)} for a friend, number {i}.",
            int(min(96, max(4, rng.lognormvariate(3.2, 0.6)))),
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class StreamResult:
    """One greedy stream as the client saw it: the usage it was billed and what it read."""

    completion_tokens: int
    prompt_tokens: int
    ttft_s: float | None  # seconds to the first content
    text: str


async def stream(client: Any, model: str, prompt: str, max_tokens: int) -> StreamResult:
    started = time.perf_counter()
    first: float | None = None
    usage = None
    text: list[str] = []
    chunks = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the stream ended without its usage")
    return StreamResult(usage.completion_tokens, usage.prompt_tokens, first, "".join(text))


def create_tenant(redis_url: str) -> str:
    """An unlimited tenant ``bench`` in the served Loom's Redis; its new API key."""
    from tenancy.models import Quotas, Tenant
    from tenancy.settings import TenancySettings
    from tenancy.store_redis import RedisTenantStore

    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    store.create_tenant(Tenant(id="bench", quotas=Quotas.unlimited()), actor="loom-bench")
    return store.create_key("bench", actor="loom-bench").plaintext.get_secret_value()


def served_pids(serve_pid: int) -> dict[str, int]:
    """The processes profiled: each gateway (``gateway``, ``gateway-2``...) and each engine replica
    (``replica``, ``replica-2``...)."""
    pids = {}
    tree = [serve_pid, *descendants(serve_pid)]
    for r in ("gateway", "replica"):
        for i, pid in enumerate(sorted(p for p in tree if role(p, serve_pid, -1) == r)):
            pids[r if i == 0 else f"{r}-{i + 1}"] = pid
    return pids


async def _run(
    n: int, seed: int, log: Any, profile_dir: Path | None = None, gateways: int = 0
) -> dict[str, Any]:
    from openai import AsyncOpenAI

    served = ServedLoom.create(
        replicas=1,
        engine_env={"LOOM_ENGINE_MAX_NUM_SEQS": "64", "LOOM_ENGINE_DTYPE": "float32"},
        embedded=True,
        gateways=gateways,
    )
    try:
        t0 = time.monotonic()
        await served.start()
        log(f"served in {time.monotonic() - t0:.0f} s at {served.http_address}")
        key = create_tenant(served.redis_url)
        client = AsyncOpenAI(
            base_url=f"http://{served.http_address}/v1", api_key=key, max_retries=0, timeout=600
        )
        model = (await client.models.list()).data[0].id
        await asyncio.gather(*(stream(client, model, p, m) for p, m in workload(4, seed + 1)))  # warm-up
        # What each process spends with nothing to serve (Serve's and Ray's periodic work, pollers):
        # a cost per second, not per token, which a faster engine spreads over more tokens.
        idle0 = snapshot(served.pid, os.getpid())
        await asyncio.sleep(IDLE_WINDOW_S)
        idle = cpu_by_group(idle0, snapshot(served.pid, os.getpid()))
        items = workload(n, seed)
        profiles: dict[str, Path] = {}
        with contextlib.ExitStack() as stack:
            if profile_dir is not None:
                profiles = stack.enter_context(recording(served_pids(served.pid), profile_dir))
                await asyncio.sleep(1.0)  # py-spy attaches before the window opens
            before = snapshot(served.pid, os.getpid())
            wall0 = time.perf_counter()
            results = await asyncio.gather(*(stream(client, model, p, m) for p, m in items))
            wall = time.perf_counter() - wall0
            after = snapshot(served.pid, os.getpid())
        await client.close()
    finally:
        await served.stop()
        served.remove()
    tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    groups = cpu_by_group(before, after)
    gateway_cpu = groups.get("gateway", 0.0)
    return {
        "gateways": gateway_processes(gateways),
        "gateway_cores_busy": round(gateway_cpu / wall, 3),
        "tokens_per_gateway_cpu_s": round(tokens / gateway_cpu) if gateway_cpu else None,
        "workload": {
            "requests": n,
            "seed": seed,
            "max_tokens_sum": sum(m for _, m in items),
            "arrival": "all at once",
            "front": "HTTP, openai SDK, stream=True, temperature 0",
            "engine": "1 replica, embedded SmolLM2-135M-Instruct, float32, max_num_seqs 64",
        },
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "cpu": per_token(groups, tokens),
        "openmp_workers_with_the_loop": True,  # AsyncEngine.launch names them loom-engine
        "idle_window_s": IDLE_WINDOW_S,
        "idle_ms_per_s": {g: round(1e3 * c / IDLE_WINDOW_S, 2) for g, c in sorted(idle.items())},
        "net_of_idle_ms_per_token": {
            g: round(1e3 * (c - wall * idle.get(g, 0.0) / IDLE_WINDOW_S) / tokens, 4) if tokens else 0.0
            for g, c in sorted(groups.items())
        },
        "replica_threads": busiest_threads(before, after, "replica"),
        "gateway_threads": busiest_threads(before, after, "gateway"),
        "targets_ms_per_token": {"gateway": 0.15, "replica_rest": 0.1},
        "profiles": {name: _profile_row(path) for name, path in sorted(profiles.items())},
    }


def gateway_processes(gateways: int) -> str:
    return "1, in the loom serve process" if gateways == 0 else f"{gateways}, as Serve replicas"


def _profile_row(path: Path) -> dict[str, Any]:
    summary = summarise(path)
    return {
        "file": f"{path.parent.name}/{path.name}",
        "samples": summary.samples,
        "top_self": summary.top_self,
        "by_library": summary.by_library,
    }


def to_markdown(report: dict[str, Any]) -> str:
    return render("stream-cost.md.j2", report=report)


def run_benchmark(
    n: int = 96,
    seed: int = 0,
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
    profile: bool = False,
) -> dict[str, Any]:
    profile_dir = (out_dir or RESULTS_DIR) / "profiles" / "stream-cost" if profile else None
    report = asyncio.run(_run(n, seed, log, profile_dir))
    report.update(date=time.strftime("%Y-%m-%d"), machine=cpu_line(), machine_cpu=cpu_info())
    if out_dir is not None:
        write_report(out_dir, "stream-cost", report, to_markdown(report))
    return report


def run_gateway_sweep(
    counts: list[int], n: int = 96, seed: int = 0, out_dir: Path | None = RESULTS_DIR, log: Any = print
) -> dict[str, Any]:
    """The same load over each gateway layout (0: in the loom serve process; N: N Serve replicas
    sharing the ports): tokens/s, and tokens per CPU-second of the gateway processes together."""
    rows = []
    for count in counts:
        log(f"gateways: {gateway_processes(count)}")
        report = asyncio.run(_run(n, seed, log, None, gateways=count))
        rows.append(
            {
                "gateways": report["gateways"],
                "output_tokens": report["output_tokens"],
                "output_tokens_per_s": report["output_tokens_per_s"],
                "ttft_p50_s": report["ttft_p50_s"],
                "gateway_ms_per_token": report["cpu"]["gateway"]["ms_per_output_token"],
                "gateway_cores_busy": report["gateway_cores_busy"],
                "tokens_per_gateway_cpu_s": report["tokens_per_gateway_cpu_s"],
                "replica_engine_ms_per_token": report["cpu"]["replica_engine_thread"]["ms_per_output_token"],
            }
        )
        log(f"  {rows[-1]}")
    sweep = {
        "workload": report["workload"],
        "counts": counts,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d"),
        "machine": cpu_line(),
        "machine_cpu": cpu_info(),
    }
    if out_dir is not None:
        write_report(out_dir, "stream-cost-gateways", sweep, sweep_markdown(sweep))
    return sweep


def sweep_markdown(sweep: dict[str, Any]) -> str:
    return render("stream-cost-gateways.md.j2", report=sweep)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stream-cost", help="CPU per streamed output token of each served process (~3 min)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also sample the gateway and the replica with py-spy (results/profiles/stream-cost/)",
    )
    p.add_argument(
        "--gateways",
        default=None,
        help="instead: sweep gateway layouts, e.g. 0,1,2 (0: in the loom serve process; N: N Serve "
        "replicas sharing the ports) into results/stream-cost-gateways.md (about 2 min each)",
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    if args.gateways:
        counts = [int(c) for c in args.gateways.split(",")]
        print(sweep_markdown(run_gateway_sweep(counts, args.requests, args.seed, args.out, log)))
        return 0
    report = run_benchmark(args.requests, args.seed, args.out, log=log, profile=args.profile)
    print(to_markdown(report))
    return 0
