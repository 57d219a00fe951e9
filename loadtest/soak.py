"""``loom soak``: minutes of mixed traffic against a served Loom while its parts are broken on a
schedule, every delivered stream checked token for token, and nothing left behind at the end.

What runs (by default, against a Loom it starts itself: ``loom serve`` with two engine replicas of a
tiny random model, the Redis tenant store on a private ``redis-server``; all on loopback):

* load: ``--concurrency`` clients loop over four tenants (interactive, standard, batch ceilings; one
  with tight quotas that gets refusals), gRPC and the HTTP front, priority hints, greedy requests
  of assorted lengths; a fifth of the streams are abandoned at a random point;
* faults, on a schedule: an engine replica SIGKILLed (``--kill-every``), Redis stopped for
  ``--outage`` seconds and restarted (``--outage-every``), a burst of streams that all disconnect
  early (``--burst-every``);
* checks: every stream against the greedy run of the same request by the engine in this process, on
  the same weights (completed: equal token for token; cut: its beginning); at the end, every replica
  idle (no KV block, nothing running or waiting), no lease in Redis, each request charged at least
  what its client received (exactly that if it completed), and each tenant's metered usage equal to
  the sum of its requests' charges; resident memory of the gateway and the replicas sampled.

Writes ``soak.json`` and ``soak.md`` under ``--out``. ``--address`` points it at a server someone else
started (faults and store checks are then off; the reference comes from clean requests).
``--fuzz N`` instead sends N fuzz cases (loadtest/soak_fuzz.py) and reports the codes seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from common import Priority
from gateway.grpc.client import LoomClient
from loadtest.machine import cpu_line
from loadtest.markdown import render
from loadtest.soak_fuzz import Target, fuzz
from loadtest.soak_server import (
    SECRET,
    ServedLoom,
    histogram_quantile,
    loop_lag_buckets,
    replica_gauges,
    rss_mb,
)
from loadtest.soak_streams import (
    GreedyReference,
    Outputs,
    Received,
    check_streams,
    grpc_stream,
    http_stream,
    served_reference,
)
from tenancy import RedisTenantStore, TenancySettings
from tenancy.models import Quotas, Tenant
from tenancy.redis_layout import RedisLayout

RESULTS_DIR = Path(__file__).parent / "results"
log = logging.getLogger("loom.soak")

# Lengths a request asks for: a discrete set, so the greedy references stay few (48 prompts x 12).
MAX_TOKENS = (1, 2, 5, 8, 16, 32, 48, 64, 100, 128, 200, 256)
TOPICS = ("the loom", "a river", "tokens", "the weaver", "Redis", "a replica", "cold tea", "KV blocks")
PROMPTS = tuple(f"{topic} {i}: " + "tell me more " * (i % 6) for i, topic in enumerate(TOPICS * 6))
PRIORITIES = (None, Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH)
_PB_PRIORITY = {Priority.INTERACTIVE: 1, Priority.STANDARD: 2, Priority.BATCH: 3}


@dataclass(frozen=True)
class TenantPlan:
    name: str
    share: float  # of the load
    fields: dict[str, Any]


TENANT_QUOTAS_LIMITED = {"max_concurrent": 2, "requests_per_minute": 120}
TENANTS = (
    TenantPlan(
        "soak-chat", 0.3, {"priority_ceiling": "interactive", "default_priority": "interactive", "weight": 2}
    ),
    TenantPlan("soak-standard", 0.3, {}),
    TenantPlan("soak-batch", 0.3, {"priority_ceiling": "batch", "default_priority": "batch"}),
    # Tight quotas: its refusals (RESOURCE_EXHAUSTED / 429) are part of the mix.
    TenantPlan("soak-limited", 0.1, {"quotas": TENANT_QUOTAS_LIMITED}),
)


@dataclass
class SoakConfig:
    minutes: float = 10.0
    concurrency: int = 12
    seed: int = 0
    replicas: int = 2
    kill_every_s: float = 150.0
    outage_every_s: float = 180.0
    outage_s: float = 10.0
    burst_every_s: float = 60.0
    burst_size: int = 80
    sample_every_s: float = 15.0
    address: str | None = None  # a server someone else started
    http_address: str | None = None
    api_keys: list[str] = field(default_factory=list)
    model: str = "tiny"
    # A process whose resident memory still grows faster than this over its last two minutes fails the
    # soak: a leak shows as a steady slope after warm-up (an SDPA prefill path once grew 24 MiB/min).
    max_growth_mb_per_min: float = 5.0


@dataclass
class Fault:
    at_s: float
    kind: str
    detail: str


@dataclass
class Run:
    """Everything the soak records while it runs."""

    started: float = field(default_factory=time.monotonic)
    streams: list[Received] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 1)


# ---- the load --------------------------------------------------------------------------------------


class Load:
    def __init__(
        self, cfg: SoakConfig, keys: dict[str, str], grpc_address: str, http_address: str | None
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.clients = {name: LoomClient(grpc_address, key) for name, key in keys.items()}
        self.http = (
            httpx.AsyncClient(
                base_url=f"http://{http_address}", timeout=120, limits=httpx.Limits(max_connections=256)
            )
            if http_address
            else None
        )
        self.shares = [next((t.share for t in TENANTS if t.name == name), 1.0) for name in keys]

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        if self.http is not None:
            await self.http.aclose()

    async def one(self, run: Run, rng: random.Random, *, early_exit: bool = False) -> Received:
        """One request: a tenant, a front, a prompt, a length, a priority hint; maybe abandoned."""
        name = rng.choices(list(self.keys), weights=self.shares)[0]
        r = Received(name, rng.choice(PROMPTS), rng.choice(MAX_TOKENS), model=self.cfg.model)
        run.streams.append(r)
        over_http = self.http is not None and rng.random() < 0.3
        hint = rng.choice(PRIORITIES)
        if early_exit:
            mode = rng.choice(["tokens", "timer"])
        else:
            mode = rng.choices(["complete", "tokens", "timer"], weights=[75, 20, 5])[0]
        cancel_after = rng.randint(1, max(1, r.max_tokens)) if mode == "tokens" else None
        if early_exit and cancel_after is not None:
            cancel_after = rng.randint(1, 5)
        if over_http:
            assert self.http is not None
            extra = {"priority": hint.value} if hint is not None else {}
            work = http_stream(self.http, self.keys[name], r, cancel_after=cancel_after, **extra)
        else:
            extra = {"priority": _PB_PRIORITY[hint]} if hint is not None else {}
            work = grpc_stream(self.clients[name], r, cancel_after=cancel_after, **extra)
        task = asyncio.ensure_future(work)
        if mode == "timer":
            done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.15 if early_exit else 1.0))
            if not done:
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a cancel of ours is its result, not raised
        return r

    async def worker(self, run: Run, rng: random.Random, until: float) -> None:
        while time.monotonic() < until:
            r = await self.one(run, rng)
            if r.code in ("RESOURCE_EXHAUSTED", "429"):
                await asyncio.sleep(rng.uniform(0.1, 0.5))  # a refused client backs off

    async def burst(self, run: Run, rng: random.Random) -> None:
        """Streams that all leave early: a disconnect storm in miniature."""
        seeds = [rng.getrandbits(64) for _ in range(self.cfg.burst_size)]
        await asyncio.gather(*(self.one(run, random.Random(s), early_exit=True) for s in seeds))


# ---- faults and samples ------------------------------------------------------------------------------


async def inject_faults(cfg: SoakConfig, served: ServedLoom, load: Load, run: Run, until: float) -> None:
    """The fault schedule: first burst at 30 s, first kill at 60 s, first outage at 120 s, then at
    their intervals (an interval of 0 turns a fault off); none starts that would not end before the
    load stops."""
    rng = random.Random(cfg.seed + 1)
    every = {"burst": cfg.burst_every_s, "kill": cfg.kill_every_s, "outage": cfg.outage_every_s}
    due = {k: first for k, first in (("burst", 30.0), ("kill", 60.0), ("outage", 120.0)) if every[k] > 0}
    bursts: list[asyncio.Task[None]] = []
    while due:
        kind = min(due, key=lambda k: due[k])
        at = run.started + due[kind]
        if at + (cfg.outage_s + 5 if kind == "outage" else 5) > until:
            del due[kind]
            continue
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        due[kind] += every[kind]
        if kind == "kill":
            pids = served.replica_pids()
            if pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                run.faults.append(
                    Fault(run.now(), "replica SIGKILL", f"pid {victim} of {len(pids)} replicas")
                )
        elif kind == "outage" and served.redis is not None:
            await asyncio.to_thread(served.redis.stop)
            run.faults.append(Fault(run.now(), "Redis stopped", f"for {cfg.outage_s:g} s"))
            await asyncio.sleep(cfg.outage_s)
            await asyncio.to_thread(served.redis.start)
            run.faults.append(Fault(run.now(), "Redis restarted", "append-only file reloaded"))
        elif kind == "burst":
            run.faults.append(Fault(run.now(), "disconnect burst", f"{cfg.burst_size} streams leave early"))
            bursts.append(asyncio.create_task(load.burst(run, random.Random(rng.getrandbits(64)))))
    await asyncio.gather(*bursts)


async def sample_memory(served: ServedLoom | None, run: Run, every_s: float) -> None:
    while served is not None:
        row: dict[str, Any] = {"at_s": run.now(), "gateway_mb": rss_mb(served.pid)}
        row["replicas_mb"] = {str(p): rss_mb(p) for p in served.replica_pids()}
        run.memory.append(row)
        await asyncio.sleep(every_s)


# ---- the checks at the end -------------------------------------------------------------------------


async def wait_idle(served: ServedLoom, replicas: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """Every replica (all ``replicas`` of them, replacements included) idle, by the gateway's metrics."""
    deadline = time.monotonic() + timeout_s
    gauges: dict[str, Any] = {}
    while time.monotonic() < deadline:
        await asyncio.sleep(3.0)  # replicas publish every second, changes only: let the last arrive
        gauges = await asyncio.to_thread(replica_gauges, served.metrics_url)
        if len(gauges) >= replicas and all(g.idle for g in gauges.values()):
            break
    return {rid: vars(g) for rid, g in gauges.items()}


def billing(redis_url: str, tenants: dict[str, str], streams: list[Received]) -> dict[str, Any]:
    """Per tenant: what each request was charged (its record in Redis) against what its client received,
    the metered usage against the sum of the charges, and the leases left."""
    layout = RedisLayout("loom")
    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    out: dict[str, Any] = {}
    try:
        for name, tenant_id in tenants.items():
            mine = [r for r in streams if r.tenant_id == name]
            pipe = client.pipeline(transaction=False)
            for r in mine:
                pipe.hmget(layout.request(tenant_id, r.request_id), "state", "completion")
            records = pipe.execute()
            under = over = unsettled = 0
            charged = admitted = 0
            slack = Counter[int]()
            for r, (state, completion) in zip(mine, records, strict=True):
                if state is None:  # never admitted (refused, or left before admission)
                    if r.tokens:
                        under += 1
                    continue
                if state != b"done":
                    unsettled += 1
                    continue
                admitted += 1
                billed = int(completion)
                charged += billed
                completed = r.finished and r.code == "OK"
                if billed < r.tokens:
                    under += 1
                elif (completed and billed != r.tokens) or billed > r.max_tokens:
                    over += 1
                slack[billed - r.tokens] += 1
            days = store.usage(tenant_id, days=2)
            out[name] = {
                "requests_sent": len(mine),
                "requests_metered": sum(d.requests for d in days),
                "requests_charged": admitted,
                "tokens_received": sum(r.tokens for r in mine),
                "tokens_metered": sum(d.completion_tokens for d in days),
                "tokens_charged": charged,
                "under_billed": under,
                "over_billed": over,
                "unsettled": unsettled,
                "charged_minus_received": dict(sorted(slack.items())),
                "leases_left": int(client.zcard(layout.leases(tenant_id))),
            }
    finally:
        client.close()
    return out


def _usage_settled(redis_url: str, tenants: dict[str, str], expected: dict[str, int]) -> bool:
    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    return all(
        sum(d.requests for d in store.usage(tid, days=2)) >= expected[name] for name, tid in tenants.items()
    )


# ---- the run ------------------------------------------------------------------------------------------


def create_tenants(redis_url: str) -> tuple[dict[str, str], dict[str, str]]:
    """The soak's tenants in the store: name -> API key, name -> tenant id."""
    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    keys, ids = {}, {}
    for plan in TENANTS:
        fields = dict(plan.fields)
        quotas = Quotas.unlimited().model_copy(update=fields.pop("quotas", {}))
        store.create_tenant(Tenant(id=plan.name, quotas=quotas, **fields), actor="loom-soak")
        keys[plan.name] = store.create_key(plan.name, actor="loom-soak").plaintext.get_secret_value()
        ids[plan.name] = plan.name
    return keys, ids


async def _ready(
    client: LoomClient, model: str, tenant: str = "probe", sent: list[Received] | None = None
) -> None:
    """Wait until the gateway knows the key and a replica answers (the probes go in ``sent``: they are
    metered like any request)."""
    deadline = time.monotonic() + 120
    while True:
        r = await grpc_stream(client, Received(tenant, PROMPTS[0], 1, model=model), timeout_s=10)
        if sent is not None:
            sent.append(r)
        if r.code == "OK":
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server does not answer: {r.code} {r.message}")
        await asyncio.sleep(0.5)


def _engine_env() -> dict[str, str]:
    # Small KV caches (preemption and recompute happen under load) and one thread per replica.
    return {
        "LOOM_ENGINE_BLOCK_SIZE": "8",
        "LOOM_ENGINE_NUM_BLOCKS": "160",
        "LOOM_ENGINE_MAX_NUM_SEQS": "8",
        "LOOM_ENGINE_NUM_THREADS": "1",
    }


async def run_soak(cfg: SoakConfig, say: Any) -> dict[str, Any]:
    # SIGTERM ends the soak like Ctrl-C: the server it started is drained and its files removed.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
    run = Run()
    served: ServedLoom | None = None
    if cfg.address is None:
        served = ServedLoom.create(cfg.replicas, _engine_env())
        say(f"starting loom serve ({cfg.replicas} replicas, a private Redis) in {served.workdir} ...")
        await served.start()
        keys, tenant_ids = create_tenants(served.redis_url)
        grpc_address, http_address = served.grpc_address, served.http_address
    else:
        keys = {f"tenant-{i}": key for i, key in enumerate(cfg.api_keys)}
        tenant_ids = {}
        grpc_address, http_address = cfg.address, cfg.http_address
    load = Load(cfg, keys, grpc_address, http_address)
    report: dict[str, Any] = {}
    try:
        for name, client in load.clients.items():
            await _ready(client, cfg.model, name, run.streams)
        reference = GreedyReference(served.model_dir) if served is not None else None
        rng = random.Random(cfg.seed)
        run.started = time.monotonic()
        until = run.started + cfg.minutes * 60
        say(f"soaking for {cfg.minutes:g} min with {cfg.concurrency} clients ...")
        sampler = asyncio.create_task(sample_memory(served, run, cfg.sample_every_s))
        faults = (
            asyncio.create_task(inject_faults(cfg, served, load, run, until))
            if served is not None
            else asyncio.create_task(_bursts_only(cfg, load, run, until))
        )
        progress = asyncio.create_task(_progress(run, until, say))
        workers = [
            asyncio.create_task(load.worker(run, random.Random(rng.getrandbits(64)), until))
            for _ in range(cfg.concurrency)
        ]
        await asyncio.gather(*workers, faults)
        load_s = time.monotonic() - run.started
        for task in (sampler, progress):
            task.cancel()
        await asyncio.gather(sampler, progress, return_exceptions=True)
        if served is not None and served.redis is not None and not served.redis.running:
            await asyncio.to_thread(served.redis.start)
        say(f"load over after {load_s:.0f} s ({len(run.streams)} requests); checking ...")

        # Token for token, against the greedy run of each request.
        wanted = {(r.prompt, r.max_tokens) for r in run.streams if r.tokens or r.finished}
        if reference is not None:
            await asyncio.to_thread(reference.compute, wanted)
            outputs: Outputs = reference.outputs
        else:
            outputs = await served_reference(next(iter(load.clients.values())), cfg.model, wanted)
        checked = [r for r in run.streams if (r.prompt, r.max_tokens) in outputs]
        mismatches = check_streams(checked, outputs)

        leaks: dict[str, Any] = {}
        if served is not None:
            expected = Counter(r.tenant_id for r in run.streams if r.code == "OK" and r.finished)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not await asyncio.to_thread(
                _usage_settled, served.redis_url, tenant_ids, expected
            ):
                await asyncio.sleep(1.0)
            replicas = await wait_idle(served, cfg.replicas)
            bills = await asyncio.to_thread(billing, served.redis_url, tenant_ids, run.streams)
            leaks = {
                "replicas_not_idle": sum(1 for g in replicas.values() if not _idle(g)),
                "replicas_seen": len(replicas),
                "kv_blocks_held": sum(g["kv_blocks_used"] for g in replicas.values()),
                "leases_left": sum(b["leases_left"] for b in bills.values()),
                "under_billed": sum(b["under_billed"] for b in bills.values()),
                "over_billed": sum(b["over_billed"] for b in bills.values()),
                "unsettled": sum(b["unsettled"] for b in bills.values()),
                "usage_mismatch": sum(
                    1
                    for b in bills.values()
                    if b["tokens_metered"] != b["tokens_charged"]
                    or b["requests_metered"] != b["requests_charged"]
                ),
                "preemptions": sum(g["preemptions"] for g in replicas.values()),
            }
            report["tenants"] = bills
        report.update(_summary(cfg, run, load_s, checked, mismatches, leaks))
    finally:
        await load.close()
        if served is not None:
            code = await served.stop()
            report["server_exit_code"] = code
            served.remove()
    return report


def _idle(gauges: dict[str, Any]) -> bool:
    return gauges["kv_blocks_used"] == 0 and gauges["running"] == 0 and gauges["waiting"] == 0


async def _bursts_only(cfg: SoakConfig, load: Load, run: Run, until: float) -> None:
    """A server someone else started: disconnect bursts are the only fault the soak can inject."""
    rng = random.Random(cfg.seed + 1)
    while cfg.burst_every_s > 0 and time.monotonic() + cfg.burst_every_s < until:
        await asyncio.sleep(cfg.burst_every_s)
        run.faults.append(Fault(run.now(), "disconnect burst", f"{cfg.burst_size} streams leave early"))
        await load.burst(run, random.Random(rng.getrandbits(64)))


async def _progress(run: Run, until: float, say: Any) -> None:
    while True:
        await asyncio.sleep(60)
        codes = Counter(r.code for r in run.streams)
        left = max(0.0, until - time.monotonic())
        done = f"{len(run.streams)} requests {dict(codes)}, {len(run.faults)} faults"
        say(f"  {run.now():.0f} s: {done}, {left:.0f} s left")


def _growth(samples: list[tuple[float, float | None]]) -> dict[str, float | None]:
    """Resident memory over a process's samples ((seconds, MiB)): first, last, max, growth, and the growth
    rate over the last two minutes of its samples (whether it still grows at the end; a process that
    lived less than three minutes has none: its first minute is warm-up, kernels and pools filling)."""
    values = [(t, mb) for t, mb in samples if mb is not None]
    out: dict[str, float | None] = dict.fromkeys(
        ("first_mb", "last_mb", "max_mb", "growth_mb", "mb_per_min_at_end")
    )
    if not values:
        return out
    out["first_mb"], out["last_mb"] = round(values[0][1], 1), round(values[-1][1], 1)
    out["max_mb"] = round(max(mb for _, mb in values), 1)
    out["growth_mb"] = round(values[-1][1] - values[0][1], 1)
    if values[-1][0] - values[0][0] >= 180:
        tail = [(t, mb) for t, mb in values if t >= values[-1][0] - 120]
        out["mb_per_min_at_end"] = round((tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0]) * 60, 1)
    return out


def memory_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway process and each replica process (a replacement is a new one) over the soak."""
    series: dict[str, list[tuple[float, float | None]]] = {}
    for m in samples:
        for pid, mb in m["replicas_mb"].items():
            series.setdefault(pid, []).append((m["at_s"], mb))
    return {
        "gateway": _growth([(m["at_s"], m["gateway_mb"]) for m in samples]),
        "replicas": {pid: _growth(points) for pid, points in series.items()},
        "samples": samples,
    }


def _processes(memory: dict[str, Any]) -> list[tuple[str, dict[str, float | None]]]:
    """Each process's name (gateway, replica PID) and its growth figures, in report order."""
    return [("gateway", memory["gateway"]), *((f"replica {p}", g) for p, g in memory["replicas"].items())]


def still_growing(memory: dict[str, Any], limit_mb_per_min: float) -> list[str]:
    """The processes whose memory grew faster than the limit at the end."""
    return [
        name
        for name, g in _processes(memory)
        if g["mb_per_min_at_end"] is not None and g["mb_per_min_at_end"] > limit_mb_per_min
    ]


def _summary(
    cfg: SoakConfig,
    run: Run,
    load_s: float,
    checked: list[Received],
    mismatches: list[str],
    leaks: dict[str, Any],
) -> dict[str, Any]:
    streams = run.streams
    codes = Counter(r.code for r in streams)
    completed = [r for r in streams if r.code == "OK" and r.finished]
    memory = memory_summary(run.memory)
    growing = still_growing(memory, cfg.max_growth_mb_per_min)
    verdict_problems = (
        len(mismatches)
        + len(growing)
        + sum(
            leaks.get(k, 0)
            for k in (
                "replicas_not_idle",
                "leases_left",
                "under_billed",
                "over_billed",
                "unsettled",
                "usage_mismatch",
            )
        )
        + codes.get("INTERNAL", 0)
        + codes.get("UNKNOWN", 0)
        + codes.get("500", 0)
    )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_line(),
        "config": {k: v for k, v in vars(cfg).items() if k != "api_keys"},
        "load_seconds": round(load_s, 1),
        "requests": len(streams),
        "requests_by_front": dict(Counter(r.front for r in streams)),
        "requests_by_code": dict(codes.most_common()),
        "completed": len(completed),
        "abandoned_by_client": sum(1 for r in streams if r.cancelled),
        "tokens_received": sum(r.tokens for r in streams),
        "tokens_verified": sum(r.tokens for r in checked),
        "streams_verified": len(checked),
        "token_mismatches": len(mismatches),
        "mismatch_examples": mismatches[:20],
        "faults": [vars(f) for f in run.faults],
        "faults_by_kind": dict(Counter(f.kind for f in run.faults)),
        "leaks": leaks,
        "memory": memory,
        "memory_still_growing": growing,
        "problems": verdict_problems,
        "verdict": "pass" if verdict_problems == 0 else "FAIL",
    }


# ---- reports ------------------------------------------------------------------------------------------


def to_markdown(report: dict[str, Any]) -> str:
    return render(
        "soak.md.j2",
        report=report,
        default_growth_limit=SoakConfig.max_growth_mb_per_min,
        processes=_processes(report["memory"]),
    )


def write(report: dict[str, Any], out_dir: Path, name: str = "soak") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(to_markdown(report))


# ---- fuzz --------------------------------------------------------------------------------------------


# What a fuzz run must hold, beyond each answer's own rules (loadtest/soak_fuzz.py).
FUZZ_RSS_GROWTH_MB = 100.0
FUZZ_LOOP_LAG_P99_S = 0.05
FUZZ_PATIENCE_S = 2.0  # the served gateway's header and body deadlines: half-sent requests end fast
VICTIM_PROMPT = "the loom weaves"


async def run_fuzz(cfg: SoakConfig, n: int, say: Any) -> dict[str, Any]:
    """``n`` fuzz cases, with a victim tenant streaming the same greedy request throughout: it must
    get the same tokens every time. Measured around the run: the gateway's resident memory, its
    event loop's lag (p99), the engine replicas (none may be replaced) and the tight-quota tenant's
    admitted requests (never more than its rate allows)."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)  # type: ignore[union-attr]
    served: ServedLoom | None = None
    if cfg.address is None:
        patience = {
            "LOOM_GATEWAY_HTTP_HEADER_TIMEOUT_S": str(FUZZ_PATIENCE_S),
            "LOOM_GATEWAY_HTTP_BODY_TIMEOUT_S": str(FUZZ_PATIENCE_S),
        }
        served = ServedLoom.create(1, _engine_env() | patience)
        say(f"starting loom serve in {served.workdir} ...")
        await served.start()
        keys, _ = create_tenants(served.redis_url)
        target = Target(
            served.grpc_address,
            served.http_address,
            keys["soak-standard"],
            cfg.model,
            keys["soak-limited"],
            FUZZ_PATIENCE_S,
        )
        victim_key = keys["soak-chat"]
    else:
        if not cfg.api_keys:
            raise SystemExit("loom soak --fuzz --address needs --api-key")
        target = Target(cfg.address, cfg.http_address, cfg.api_keys[0], cfg.model)
        victim_key = cfg.api_keys[-1]
    try:
        async with (
            LoomClient(target.grpc_address, target.api_key) as client,
            LoomClient(target.grpc_address, victim_key) as victim,
        ):
            await _ready(client, cfg.model)
            await _ready(victim, cfg.model, tenant="victim")
            reference = await grpc_stream(victim, Received("victim", VICTIM_PROMPT, 24, model=cfg.model))
            before = _server_state(served)
            started = time.monotonic()
            say(f"sending {n} fuzz cases, a victim stream beside them ...")
            fuzzing = asyncio.ensure_future(
                fuzz(target, n, seed=cfg.seed, progress=lambda k: say(f"  {k} cases"))
            )
            victim_runs = await _victim_streams(victim, cfg.model, reference, fuzzing)
            report = await fuzzing
            minutes = (time.monotonic() - started) / 60
            after = _server_state(served)
            healthy = await _healthy(client, cfg.model)
        out = report.to_dict() | {"healthy_after": healthy, "cpu": cpu_line()} | victim_runs
        checks = _fuzz_checks(before, after, served, minutes)
        out |= checks
        failed = [k for k, v in checks.items() if k.endswith("_ok") and v is False]
        ok = healthy and not report.problem_count and not victim_runs["victim_altered"] and not failed
        out["verdict"] = "pass" if ok else "FAIL"
        return out
    finally:
        if served is not None:
            out_code = await served.stop()
            say(f"server exited with status {out_code}")
            served.remove()


async def _victim_streams(
    victim: LoomClient, model: str, reference: Received, fuzzing: asyncio.Future[Any]
) -> dict[str, Any]:
    """Stream the victim's greedy request again and again until the fuzzing ends; count the runs that
    failed or whose tokens differ from the reference run's."""
    runs = altered = 0
    while not fuzzing.done():
        r = await grpc_stream(victim, Received("victim", VICTIM_PROMPT, 24, model=model), timeout_s=60)
        runs += 1
        altered += r.code != "OK" or r.token_ids != reference.token_ids
    return {"victim_streams": runs, "victim_altered": altered}


def _server_state(served: ServedLoom | None) -> dict[str, Any]:
    """What the run-level checks compare: RSS, the loop-lag histogram, the replicas."""
    if served is None or not served.metrics_url:
        return {}
    return {
        "rss_mb": rss_mb(served.pid),
        "lag": loop_lag_buckets(served.metrics_url),
        "replicas": sorted(replica_gauges(served.metrics_url)),
    }


def _fuzz_checks(
    before: dict[str, Any], after: dict[str, Any], served: ServedLoom | None, minutes: float
) -> dict[str, Any]:
    if not before or not after or served is None:
        return {}
    growth = (after["rss_mb"] or 0.0) - (before["rss_mb"] or 0.0)
    p99 = histogram_quantile(0.99, before["lag"], after["lag"])
    limited = TENANT_QUOTAS_LIMITED
    admitted = usage_requests(served.redis_url, "soak-limited")
    allowed = math.ceil(limited["requests_per_minute"] * (1 + minutes))  # a full bucket, then its refill
    return {
        "gateway_rss_growth_mb": round(growth, 1),
        "gateway_rss_ok": growth < FUZZ_RSS_GROWTH_MB,
        "event_loop_lag_p99_s": p99,
        "event_loop_lag_ok": p99 is not None and p99 <= FUZZ_LOOP_LAG_P99_S,
        "limited_admitted": admitted,
        "limited_allowed": allowed,
        "quota_ok": admitted <= allowed,
        "replica_restarts": len(set(after["replicas"]) - set(before["replicas"])),
        "replicas_ok": after["replicas"] == before["replicas"],
    }


def usage_requests(redis_url: str, tenant_id: str) -> int:
    """Requests the tenant was admitted (metered) today and yesterday, as Redis recorded them."""
    store = RedisTenantStore.from_settings(TenancySettings(store="redis", redis_url=redis_url, secret=SECRET))
    try:
        return sum(day.requests for day in store.usage(tenant_id, 2))
    finally:
        store.close()


async def _healthy(client: LoomClient, model: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reply = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(service=""))
    r = await grpc_stream(client, Received("health", "hello", 5, model=model), timeout_s=30)
    return reply.status == health_pb2.HealthCheckResponse.SERVING and r.code == "OK" and r.tokens == 5


def fuzz_markdown(report: dict[str, Any]) -> str:
    codes = sorted({c for per_kind in report["codes"].values() for c in per_kind})
    return render("fuzz.md.j2", report=report, codes=codes)


# ---- the command --------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="minutes of mixed load with faults injected, every token checked")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=12, help="clients looping over requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas of the server it starts")
    p.add_argument(
        "--kill-every", type=float, default=150.0, help="seconds between replica SIGKILLs (0: none)"
    )
    p.add_argument(
        "--outage-every", type=float, default=180.0, help="seconds between Redis outages (0: none)"
    )
    p.add_argument("--outage", type=float, default=10.0, help="seconds Redis stays down")
    p.add_argument(
        "--burst-every", type=float, default=60.0, help="seconds between disconnect bursts (0: none)"
    )
    p.add_argument("--burst-size", type=int, default=80)
    p.add_argument("--address", default=None, help="soak a running server (gRPC host:port) instead")
    p.add_argument("--http-address", default=None, help="with --address: its HTTP front (host:port)")
    p.add_argument("--api-key", action="append", default=[], help="with --address: a tenant's key (repeat)")
    p.add_argument("--model", default="tiny", help="the model to ask for")
    p.add_argument("--fuzz", type=int, default=None, metavar="N", help="send N fuzz cases instead of soaking")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    cfg = SoakConfig(
        minutes=args.minutes,
        concurrency=args.concurrency,
        seed=args.seed,
        replicas=args.replicas,
        kill_every_s=args.kill_every,
        outage_every_s=args.outage_every,
        outage_s=args.outage,
        burst_every_s=args.burst_every,
        burst_size=args.burst_size,
        address=args.address,
        http_address=args.http_address,
        api_keys=list(args.api_key),
        model=args.model,
    )
    if cfg.address is not None and not cfg.api_keys:
        print("loom soak: --address needs at least one --api-key", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        if args.fuzz is not None:
            report = asyncio.run(run_fuzz(cfg, args.fuzz, say))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "fuzz.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
            (args.out / "fuzz.md").write_text(fuzz_markdown(report))
            print(fuzz_markdown(report))
            return 0 if report["verdict"] == "pass" else 1
        report = asyncio.run(run_soak(cfg, say))
    except (asyncio.CancelledError, KeyboardInterrupt):
        say("stopped before the end (the server it started was drained and removed); no report")
        return 130
    write(report, args.out)
    print(to_markdown(report))
    return 0 if report["verdict"] == "pass" else 1
