"""What the gateway path costs: one-token completions through three paths to the same engine replica.

* ``engine_inprocess``: an AsyncEngine in this process (no Ray, no gRPC): the engine's own time.
* ``serve_handle``: the gateway's engine pool alone (ServeEnginePool: a DeploymentHandle call into the
  Ray Serve replica, its deltas on the pool's stream from that replica; Ray dispatch, no gateway).
* ``gateway``: a gRPC client over loopback -> the gateway (auth, validation, tokenization, Redis
  admission, lease, usage accounting) -> the same DeploymentHandle -> the replica.
* ``http_stream`` / ``http_whole``: the OpenAI-compatible front over the same path, through aiohttp
  (the client of vLLM's and SGLang's serving benchmarks), streamed as server-sent events or whole.
* ``http_stream_httpx``: the streamed front through httpx, the transport of the ``openai`` SDK. It is
  reported beside, not used for the front's cost: the client runs in this process and on these cores,
  and httpx's pure-Python HTTP/1.1 costs about 2 ms a request on its own (measured against aiohttp on a
  bare endpoint), which would be charged to the front otherwise.

Requests go one at a time (no queueing), the three paths interleaved round-robin so machine noise
hits them alike; each is a 1-token greedy completion of a short prompt on a tiny random model, so
engine time is small and constant. Writes ``gateway.json`` and ``gateway.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from loadtest.machine import cpu_line
from loadtest.markdown import render

RESULTS_DIR = Path(__file__).parent / "results"


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _summary(xs: list[float]) -> dict[str, float]:
    ms = [x * 1e3 for x in xs]
    return {
        "p50_ms": round(_pct(ms, 0.5), 3),
        "p99_ms": round(_pct(ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def _run(n: int, redis_url: str, log: Any) -> dict[str, Any]:
    import ray
    from ray import serve

    from gateway.grpc.client import LoomClient
    from gateway.grpc.stubs import pb
    from gateway.settings import GatewaySettings
    from loadtest.tiny_model import random_checkpoint, save_hf_dir
    from protocol.engine_config import EngineConfig
    from protocol.model_files import load_tokenizer
    from protocol.requests import GenerationRequest, SamplingParams
    from serving.bootstrap import serve_route, start_gateway, start_ray, start_serve
    from serving.replica import engine_deployment
    from tenancy import RedisTenantStore, TenancySettings
    from tenancy.models import SHARED_POOL, Quotas, Tenant
    from worker.api import AsyncEngine, LLMEngine

    workdir = Path(tempfile.mkdtemp(prefix="loom-bench-gw-"))
    model_dir = save_hf_dir(random_checkpoint(), workdir / "tiny")
    engine_config = EngineConfig(model_path=str(model_dir), kv_cache_memory_mb=8, num_threads=1)

    log("starting Ray and the engine replica ...")
    start_ray(num_cpus=4)
    start_serve()
    app = engine_deployment(engine_config, name=f"engine-{SHARED_POOL}", pool=SHARED_POOL)
    handle = serve.run(app, name="bench-engine", route_prefix=None)
    local = AsyncEngine.launch(lambda: LLMEngine(engine_config))

    prefix = f"loombench-{uuid.uuid4().hex[:8]}"
    tenancy_settings = TenancySettings(
        store="redis", redis_url=redis_url, key_prefix=prefix, secret="bench-secret-0123456789"
    )
    store = RedisTenantStore.from_settings(tenancy_settings)
    store.create_tenant(Tenant(id="bench", quotas=Quotas.unlimited()), actor="bench")
    key = store.create_key("bench", actor="bench").plaintext.get_secret_value()
    gateway = await start_gateway(
        GatewaySettings(port=0, http_port=0, metrics_port=None),
        tenancy_settings,
        [serve_route(handle, SHARED_POOL, model_dir)],
    )
    server = gateway.server
    tok = load_tokenizer(model_dir)
    client = LoomClient(server.address, key)
    prompt = "hello loom"
    ids = tok.encode(prompt)
    pool = serve_route(handle, SHARED_POOL, model_dir).pool

    async def inprocess() -> None:
        async for _ in local.generate(GenerationRequest(uuid.uuid4().hex, ids, SamplingParams(max_tokens=1))):
            pass

    async def via_handle() -> None:
        async for _ in pool.generate(GenerationRequest(uuid.uuid4().hex, ids, SamplingParams(max_tokens=1))):
            pass

    async def via_gateway() -> None:
        request = pb.GenerateRequest(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0)
        async for _ in client.generate_call(request):
            pass

    auth = {"authorization": f"Bearer {key}"}
    base_url = f"http://{server.http_address}"
    http = aiohttp.ClientSession(base_url=base_url, headers=auth, timeout=aiohttp.ClientTimeout(total=30))
    httpx_client = httpx.AsyncClient(base_url=base_url, headers=auth, timeout=30)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}

    async def via_http_stream() -> None:
        async with http.post("/v1/completions", json={**body, "stream": True}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP front answered {r.status}")
            # Read to the end (after "data: [DONE]"), so the connection is kept for the next request.
            events = [line async for line in r.content]
        if events[-2:] != [b"data: [DONE]\n", b"\n"]:
            raise RuntimeError(f"the stream did not end with [DONE]: {events[-2:]}")

    async def via_http_whole() -> None:
        async with http.post("/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP front answered {r.status}: {await r.text()}")
            await r.json()

    async def via_http_stream_httpx() -> None:
        async with httpx_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for _line in r.aiter_lines():
                pass
        if r.status_code != 200:
            raise RuntimeError(f"HTTP front answered {r.status_code}")

    paths = {
        "engine_inprocess": inprocess,
        "serve_handle": via_handle,
        "gateway": via_gateway,
        "http_stream": via_http_stream,
        "http_whole": via_http_whole,
        "http_stream_httpx": via_http_stream_httpx,
    }
    for fn in paths.values():  # warm-up: connections, JIT paths, caches
        for _ in range(20):
            await fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    log(f"measuring {n} requests per path ...")
    for _ in range(n):
        for name, fn in paths.items():
            t = time.perf_counter()
            await fn()
            samples[name].append(time.perf_counter() - t)

    await client.close()
    await http.close()
    await httpx_client.aclose()
    await gateway.stop(grace_s=0)
    local.shutdown()
    serve.shutdown()
    ray.shutdown()
    import redis

    r = redis.Redis.from_url(redis_url)
    for k in r.scan_iter(match=f"{prefix}*"):
        r.delete(k)
    r.close()

    result = {name: _summary(xs) for name, xs in samples.items()}
    added = {
        "gateway_over_serve_handle_p50_ms": round(
            result["gateway"]["p50_ms"] - result["serve_handle"]["p50_ms"], 3
        ),
        "gateway_over_serve_handle_p99_ms": round(
            result["gateway"]["p99_ms"] - result["serve_handle"]["p99_ms"], 3
        ),
        "gateway_over_engine_p50_ms": round(
            result["gateway"]["p50_ms"] - result["engine_inprocess"]["p50_ms"], 3
        ),
        "gateway_over_engine_p99_ms": round(
            result["gateway"]["p99_ms"] - result["engine_inprocess"]["p99_ms"], 3
        ),
        **{
            f"{front}_over_grpc_{q}_ms": round(result[front][f"{q}_ms"] - result["gateway"][f"{q}_ms"], 3)
            for front in ("http_stream", "http_whole", "http_stream_httpx")
            for q in ("p50", "p99")
        },
    }
    return {"paths": result, "added": added}


def versions() -> dict[str, str]:
    import grpc
    import ray
    import redis
    import torch

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "grpcio": grpc.__version__,
        "redis-py": redis.__version__,
        "torch": torch.__version__,
    }


def to_markdown(report: dict[str, Any]) -> str:
    return render("gateway.md.j2", report=report)


def run_benchmark(
    n: int = 300,
    redis_url: str = "redis://127.0.0.1:6379/0",
    out_dir: Path | None = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:
    report = asyncio.run(_run(n, redis_url, log))
    report.update(requests=n, date=time.strftime("%Y-%m-%d"), versions=versions(), cpu=cpu_line())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gateway.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "gateway.md").write_text(to_markdown(report))
    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="latency the gateway adds over calling the engine (about 1 min)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    report = run_benchmark(args.requests, args.redis_url, args.out, log=lambda m: print(m, file=sys.stderr))
    print(to_markdown(report))
    return 0
