"""Tokenization cannot stall the gateway: one tenant streams while another floods it with 1 MB prompts.

One run, three phases of ``--phase-seconds`` each: the streaming tenant alone, then with the senders,
then alone again. The streaming tenant keeps ``--streams`` greedy streams going through the gateway
(gRPC; client in the gateway's process, so every stall of its event loop shows in the gaps) and we
record the gap between consecutive tokens of each stream. The senders run in a separate process (their
own serialization must not stall our loop) and send, round robin: a gRPC prompt of exactly the prompt
limit (1,000,000 bytes: validated, then tokenized off the event loop, then refused for the context), a
gRPC prompt just over it (1 MiB: refused before any tokenizing), the same limit-size prompt as a chat
message (the chat template path), and the limit-size prompt over the HTTP front.

Gateway in this process, one Ray Serve replica of a tiny random model, Redis admission on the local
Redis. Writes ``isolation.json`` and ``isolation.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import string
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.machine import cpu_line
from loadtest.markdown import render

RESULTS_DIR = Path(__file__).parent / "results"
LIMIT_BYTES = 1_000_000  # worker.api.LIMITS.max_prompt_bytes
OVER_BYTES = 1 << 20


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _gaps(xs: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs]
    return {
        "gaps": len(ms),
        "p50_ms": round(_pct(ms, 0.5), 2),
        "p99_ms": round(_pct(ms, 0.99), 2),
        "p999_ms": round(_pct(ms, 0.999), 2),
        "max_ms": round(max(ms), 2) if ms else float("nan"),
        "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan"),
    }


# ---- the 1 MB senders (a process of their own) ---------------------------------------------------


def _flood_process(
    grpc_address: str, http_address: str, key: str, seconds: float, senders: int, out: Any
) -> None:
    out.put(asyncio.run(_flood(grpc_address, http_address, key, seconds, senders)))


async def _flood(
    grpc_address: str, http_address: str, key: str, seconds: float, senders: int
) -> dict[str, Any]:
    import grpc
    import httpx

    from gateway.grpc.stubs import pb, pb_grpc

    rng = random.Random(1)
    alphabet = string.ascii_letters + string.digits + " .,"
    at_limit = "".join(rng.choice(alphabet) for _ in range(LIMIT_BYTES))
    over = at_limit + "x" * (OVER_BYTES - LIMIT_BYTES)
    kinds = ("grpc_prompt_at_limit", "grpc_prompt_over_limit", "grpc_chat_at_limit", "http_prompt_at_limit")
    codes: dict[str, Counter[str]] = {k: Counter() for k in kinds}
    latency: dict[str, list[float]] = {k: [] for k in kinds}
    sent_bytes = 0
    until = time.monotonic() + seconds
    channel = grpc.aio.insecure_channel(grpc_address)
    stub = pb_grpc.InferenceStub(channel)
    metadata = (("authorization", f"Bearer {key}"),)
    http = httpx.AsyncClient(base_url=f"http://{http_address}", timeout=60)

    async def one(kind: str) -> None:
        nonlocal sent_bytes
        started = time.perf_counter()
        if kind.startswith("grpc"):
            if kind == "grpc_chat_at_limit":
                request = pb.GenerateRequest(model="tiny", max_tokens=1)
                request.messages.add(role="user", content=at_limit[: LIMIT_BYTES - 64])
            else:
                prompt = at_limit if kind == "grpc_prompt_at_limit" else over
                request = pb.GenerateRequest(model="tiny", prompt=prompt, max_tokens=1)
            try:
                async for _ in stub.Generate(request, metadata=metadata, timeout=60):
                    pass
                code = "OK"
            except grpc.aio.AioRpcError as err:
                code = err.code().name
            sent_bytes += request.ByteSize()
        else:
            body = {"model": "tiny", "prompt": at_limit, "max_tokens": 1}
            r = await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            code = f"HTTP {r.status_code}"
            sent_bytes += LIMIT_BYTES
        codes[kind][code] += 1
        latency[kind].append(time.perf_counter() - started)

    async def sender(i: int) -> None:
        n = i
        while time.monotonic() < until:
            await one(kinds[n % len(kinds)])
            n += 1

    await asyncio.gather(*(sender(i) for i in range(senders)))
    await channel.close()
    await http.aclose()
    return {
        "requests": {k: dict(c) for k, c in codes.items()},
        "answer_p50_ms": {k: round(_pct(v, 0.5) * 1e3, 1) for k, v in latency.items()},
        "megabytes_sent_per_s": round(sent_bytes / 1e6 / seconds, 2),
    }


# ---- the streaming tenant ------------------------------------------------------------------------


async def _stream_for(client: Any, seconds: float, streams: int, max_tokens: int) -> dict[str, Any]:
    from gateway.grpc.stubs import pb

    gaps: list[float] = []
    tokens = 0
    until = time.monotonic() + seconds

    async def loop(i: int) -> None:
        nonlocal tokens
        n = 0
        while time.monotonic() < until:
            request = pb.GenerateRequest(
                model="tiny", prompt=f"stream {i} round {n}", max_tokens=max_tokens, temperature=0.0
            )
            last = None
            async for chunk in client.generate_call(request, timeout=120):
                now = time.perf_counter()
                if chunk.token_ids and last is not None:
                    gaps.append(now - last)
                if chunk.token_ids:
                    last = now
                    tokens += len(chunk.token_ids)
            n += 1

    started = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(streams)))
    return _gaps(gaps) | {"tokens_per_s": round(tokens / (time.monotonic() - started), 1)}


# ---- the victim: another tenant's 20 KB prompts, each timed to its first token ---------------------

VICTIM_PROMPT_BYTES = 20_000


async def _victim_ttft(client: Any, seconds: float, seed: int) -> dict[str, Any]:
    """Send a fresh 20 KB prompt (no prefix-cache hit: different words each time), one at a time with
    a pause, for ``seconds``; its time to first token each time."""
    from gateway.grpc.stubs import pb
    from loadtest.words import WORDS

    rng = random.Random(seed)
    ttfts: list[float] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < VICTIM_PROMPT_BYTES:
            words.append(rng.choice(WORDS))
        prompt = " ".join(words)[:VICTIM_PROMPT_BYTES]
        request = pb.GenerateRequest(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0)
        started = time.perf_counter()
        async for chunk in client.generate_call(request, timeout=120):
            if chunk.token_ids:
                ttfts.append(time.perf_counter() - started)
                break
        await asyncio.sleep(0.3)
    ms = [t * 1e3 for t in ttfts]
    return {
        "prompts": len(ms),
        "p50_ms": round(_pct(ms, 0.5), 1),
        "p90_ms": round(_pct(ms, 0.9), 1),
        "max_ms": round(max(ms), 1) if ms else float("nan"),
    }


class _LoopLag:
    """How late the gateway's event loop wakes a coroutine that sleeps 5 ms: its stalls, directly."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.stop = False

    async def run(self) -> None:
        while not self.stop:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - before - 0.005)


async def _run(phase_s: float, streams: int, senders: int, redis_url: str, log: Any) -> dict[str, Any]:
    import ray
    from ray import serve

    from gateway.grpc.client import LoomClient
    from gateway.settings import GatewaySettings
    from loadtest.tiny_model import save_hf_dir
    from protocol.engine_config import EngineConfig
    from serving.bootstrap import serve_route, start_gateway, start_ray, start_serve
    from serving.replica import engine_deployment
    from tenancy import RedisTenantStore, TenancySettings
    from tenancy.models import SHARED_POOL, Quotas, Tenant

    workdir = Path(tempfile.mkdtemp(prefix="loom-bench-isolation-"))
    model_dir = save_hf_dir(_tiny_with_a_real_tokenizer(), workdir / "tiny")
    log("starting Ray and the engine replica ...")
    start_ray(num_cpus=4)
    start_serve()
    engine = EngineConfig(model_path=str(model_dir), kv_cache_memory_mb=32, num_threads=1)
    app = engine_deployment(engine, name=f"engine-{SHARED_POOL}", pool=SHARED_POOL)
    handle = serve.run(app, name="bench-isolation", route_prefix=None)
    prefix = f"loombench-{uuid.uuid4().hex[:8]}"
    settings = TenancySettings(
        store="redis", redis_url=redis_url, key_prefix=prefix, secret="bench-secret-0123456789"
    )
    store = RedisTenantStore.from_settings(settings)
    keys = {}
    # The flooder has the default quotas a new tenant gets: its bounds before admission are the point.
    for name, quotas in (
        ("streamer", Quotas.unlimited()),
        ("victim", Quotas.unlimited()),
        ("flooder", Quotas()),
    ):
        store.create_tenant(Tenant(id=name, quotas=quotas), actor="bench")
        keys[name] = store.create_key(name, actor="bench").plaintext.get_secret_value()
    gateway = await start_gateway(
        GatewaySettings(port=0, http_port=0, metrics_port=None),
        settings,
        [serve_route(handle, SHARED_POOL, model_dir)],
    )
    server = gateway.server
    assert server.http_address is not None
    client = LoomClient(server.address, keys["streamer"])
    victim = LoomClient(server.address, keys["victim"])
    phases: dict[str, Any] = {}
    flood: dict[str, Any] = {}
    try:
        await _stream_for(client, 5.0, streams, 200)  # warm-up
        for phase in ("alone", "with_1mb_senders", "alone_again"):
            log(f"phase {phase} ({phase_s:g} s) ...")
            proc = None
            if phase == "with_1mb_senders":
                ctx = multiprocessing.get_context("spawn")
                out = ctx.Queue()
                proc = ctx.Process(
                    target=_flood_process,
                    args=(server.address, server.http_address, keys["flooder"], phase_s, senders, out),
                )
                proc.start()
                await asyncio.sleep(2.0)  # the senders' process imports and builds its prompts first
            lag = _LoopLag()
            ticking = asyncio.create_task(lag.run())
            probing = asyncio.create_task(_victim_ttft(victim, phase_s, seed=len(phases)))
            phases[phase] = await _stream_for(client, phase_s, streams, 200)
            phases[phase]["victim_ttft"] = await probing
            lag.stop = True
            await ticking
            phases[phase]["event_loop_lag"] = _gaps(lag.lags)
            if proc is not None:
                flood = await asyncio.to_thread(out.get, True, 120)
                await asyncio.to_thread(proc.join, 30)
    finally:
        await client.close()
        await victim.close()
        await gateway.stop(grace_s=0)
        serve.shutdown()
        ray.shutdown()
        import redis

        r = redis.Redis.from_url(redis_url)
        for k in r.scan_iter(match=f"{prefix}*"):
            r.delete(k)
        r.close()
    alone = phases.get("alone", {}).get("victim_ttft", {}).get("p50_ms")
    flooded = phases.get("with_1mb_senders", {}).get("victim_ttft", {}).get("p50_ms")
    ratio = round(flooded / alone, 2) if alone and flooded else None
    return {"phases": phases, "flood": flood, "victim_ttft_ratio": ratio}


def _tiny_with_a_real_tokenizer() -> Any:
    """The tiny random model with SmolLM2's tokenizer: a 1 MB prompt is then one that might fit a
    context as far as its bytes tell (its longest token is 162 bytes), so the gateway must tokenize it
    to know, which is the work a flood costs; with the byte tokenizer it is refused by size at once."""
    from loadtest.tiny_model import random_weights, tiny_config
    from protocol.model_files import load_tokenizer
    from worker.api import Checkpoint

    tokenizer = load_tokenizer()
    config = tiny_config(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=8192,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    return Checkpoint("tiny-random", Path("<random>"), config, random_weights(config), tokenizer)


def to_markdown(report: dict[str, Any]) -> str:
    return render("isolation.md.j2", report=report)


def run_benchmark(
    phase_s: float = 20.0,
    streams: int = 4,
    senders: int = 4,
    redis_url: str = "redis://127.0.0.1:6379/0",
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:
    report = asyncio.run(_run(phase_s, streams, senders, redis_url, log))
    report.update(
        phase_seconds=phase_s,
        streams=streams,
        senders=senders,
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu_line(),
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "isolation.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "isolation.md").write_text(to_markdown(report))
    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "isolation", help="a tenant's token gaps while another sends 1 MB prompts (about 1.5 min)"
    )
    p.add_argument("--phase-seconds", type=float, default=20.0)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    report = run_benchmark(
        args.phase_seconds,
        args.streams,
        args.senders,
        args.redis_url,
        args.out,
        log=lambda m: print(m, file=sys.stderr),
    )
    print(to_markdown(report))
    return 0
