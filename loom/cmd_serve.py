"""``loom serve``: Ray locally, engine replicas as a Serve deployment, the gRPC gateway in front.

By default the gateway runs in this process; ``--gateway-in-serve`` deploys it as a Serve deployment
instead (how it runs on KubeRay). Ctrl-C (or SIGTERM) drains the gateway and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.engine_config import EngineConfig
from tenancy.models import SHARED_POOL

if TYPE_CHECKING:
    from gateway.settings import GatewaySettings
    from serving.start_phases import StartWatcher
    from tenancy import TenancySettings

log = logging.getLogger("loom.serve")


@dataclass(frozen=True)
class CpuPlan:
    replica_cpus: float  # each engine replica's Ray reservation
    ray_cpus: int  # the local Ray cluster's logical CPUs


def cpu_plan(cores: int, engine_replicas: int, requested: float | None, gateway_cpus: float) -> CpuPlan:
    """What each engine replica reserves, and the CPUs a local Ray cluster offers.

    Ray runs an actor's torch (OpenMP) on as many threads as the whole CPUs it reserved, so the old
    fixed reservation of 1 left a CPU engine single-threaded on a host with more cores (half the
    decode speed of the same engine offline on 2 cores). By default the host's cores are shared among
    the engine replicas; the local cluster then offers at least what the replicas and any Serve-run
    gateways reserve, so none waits unplaced for a fraction of a CPU.
    """
    replica_cpus = requested if requested is not None else float(max(1, cores // max(1, engine_replicas)))
    needed = engine_replicas * replica_cpus + gateway_cpus
    return CpuPlan(replica_cpus, max(cores, math.ceil(needed)))


def _default(field: str) -> object:
    from gateway.settings import GatewaySettings

    return GatewaySettings.model_fields[field].default


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve the gRPC API: Ray Serve engine replicas behind the gateway")
    # Unset flags fall back to GatewaySettings (LOOM_GATEWAY_* variables, then its defaults).
    p.add_argument("--host", default=None, help=f"listen address (default {_default('host')})")
    p.add_argument("--port", type=int, default=None, help=f"gRPC port (default {_default('port')})")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI-compatible HTTP port (default {_default('http_port')})",
    )
    p.add_argument("--no-http", action="store_true", help="serve gRPC only, no OpenAI-compatible HTTP front")
    p.add_argument(
        "--metrics-port", type=int, default=None, help=f"Prometheus port (default {_default('metrics_port')})"
    )
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the embedded model)")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas in the shared pool")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale the shared pool up to this many")
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs reserved per engine replica, which are also its torch threads (default: this "
        "host's cores shared among the engine replicas, at least 1)",
    )
    p.add_argument("--dedicated-pool", action="append", default=[], help="also deploy a dedicated pool NAME")
    p.add_argument(
        "--redis-url", default=None, help="use the Redis tenant store (default: .loom/tenants.yaml)"
    )
    p.add_argument("--gateway-in-serve", action="store_true", help="run the gateway as a Serve deployment")
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes sharing the ports (SO_REUSEPORT; as Serve replicas; needs --redis-url, "
        "where quotas stay exact across them)",
    )
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.set_defaults(func=run)


def _banner(address: str, http_address: str | None, demo_key: str | None, tls: bool) -> str:
    flag = " --tls-ca CA.pem" if tls else ""
    lines = [f"Loom is serving gRPC on {address}"]
    if http_address:
        scheme = "https" if tls else "http"
        lines.append(f"and the OpenAI-compatible API on {scheme}://{http_address}/v1")
    if demo_key:
        lines += [
            "",
            "Demo tenant 'demo' API key (shown once; only its hash is stored):",
            f"  {demo_key}",
            "",
            "Try it:",
            f"  .venv/bin/loom generate --address {address}{flag} --api-key {demo_key} \\",
            '      "Write a haiku about looms."',
        ]
        if http_address:
            lines += [
                f"  curl -N {scheme}://{http_address}/v1/chat/completions \\",
                f"      -H 'Authorization: Bearer {demo_key}' -H 'Content-Type: application/json' \\",
                '      -d \'{"model": "smollm2-135m-instruct", "stream": true, '
                '"messages": [{"role": "user", "content": "Write a haiku about looms."}]}\'',
            ]
    else:
        lines += ["", "Create a key with: .venv/bin/loom admin key create demo"]
    return "\n".join(lines)


async def _show_start(watcher: StartWatcher, period_s: float = 2.0) -> None:
    """While replicas start: Serve's replica states and each replica's phase, as they change."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(period_s)
        for line in await asyncio.to_thread(watcher.poll):
            print(f"  [{time.monotonic() - started:4.0f} s] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings
    from tenancy import TenancySettings, bootstrap_embedded

    tenancy = (
        TenancySettings(store="redis", redis_url=args.redis_url) if args.redis_url else TenancySettings()
    )
    flags = {
        "host": args.host,
        "port": args.port,
        "http_port": args.http_port,
        "metrics_port": args.metrics_port,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "tls_client_ca_file": args.tls_client_ca,
    }
    try:
        gateway = GatewaySettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        print(f"loom serve: {problems}", file=sys.stderr)
        return 2
    if args.no_http:
        gateway = gateway.model_copy(update={"http_port": None})
    if args.gateways > 1:
        if not args.redis_url:
            print(
                "loom serve: --gateways > 1 needs --redis-url: quotas are exact across gateway "
                "processes only when they admit in Redis",
                file=sys.stderr,
            )
            return 2
        if gateway.port == 0 or gateway.http_port == 0:
            print("loom serve: --gateways > 1 needs fixed ports (they share them)", file=sys.stderr)
            return 2
        # One metrics port per process would be needed; a shared one would answer for a random one.
        print("loom serve: the Prometheus endpoint is off with several gateway processes", file=sys.stderr)
        gateway = gateway.model_copy(update={"reuse_port": True, "metrics_port": None})
        args.gateway_in_serve = True
    demo_key = bootstrap_embedded(tenancy) if tenancy.store == "file" else None
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_serve(args, gateway, tenancy, demo_key))
    except KeyboardInterrupt:
        return 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop where installed (it comes with Ray Serve's uvicorn): a gateway's loop spends most of its
    CPU in polling and socket writes, which uvloop does in C; Ray runs the gateway on it in Serve too."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - installed with ray[serve]
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def _serve(
    args: argparse.Namespace, gateway: GatewaySettings, tenancy: TenancySettings, demo_key: str | None
) -> int:
    from serving.app import PoolSpec, engine_app, gateway_app, model_path
    from serving.bootstrap import (
        RunningGateway,
        deploy,
        serve_route,
        shutdown,
        start_gateway,
        start_ray,
        start_serve,
    )
    from serving.ingress import GATEWAY_CPUS
    from serving.start_phases import StartWatcher

    started = time.monotonic()
    engine = EngineConfig(model_path=args.model) if args.model else EngineConfig()
    names = [SHARED_POOL, *args.dedicated_pool]
    cpus = cpu_plan(
        len(os.sched_getaffinity(0)),
        (args.max_replicas or args.replicas) * len(names),
        args.replica_cpus,
        args.gateways * GATEWAY_CPUS if args.gateway_in_serve else 0.0,
    )
    pools = [
        PoolSpec(
            name=name,
            replicas=args.replicas,
            autoscale=args.max_replicas is not None,
            max_replicas=args.max_replicas or args.replicas,
            num_cpus=cpus.replica_cpus,
            engine=engine,
        )
        for name in names
    ]
    print("starting Ray and the engine replicas (the first start takes about a minute) ...", file=sys.stderr)
    # A cluster joined keeps its own CPU count; a local one offers what the plan reserves.
    await asyncio.to_thread(start_ray, args.ray_address, None if args.ray_address else cpus.ray_cpus)
    await asyncio.to_thread(start_serve)

    running: RunningGateway | None = None
    watcher = asyncio.create_task(_show_start(StartWatcher()))
    try:
        if args.gateway_in_serve:
            app = gateway_app(pools, gateway, tenancy, replicas=args.gateways)
            handle = await asyncio.to_thread(deploy, app, "loom")
            address = await handle.address.remote()
            http_address = await handle.http_address.remote()
        else:
            routes = []
            for p in pools:
                app = engine_app(p)
                handle = await asyncio.to_thread(deploy, app, p.deployment_name)
                routes.append(serve_route(handle, p.name, model_path(p)))
            running = await start_gateway(gateway, tenancy, routes)
            address, http_address = running.server.address, running.server.http_address
    finally:
        watcher.cancel()
    print(f"ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(_banner(address, http_address, demo_key, bool(args.tls_cert)), flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("\nshutting down: draining streams ...", file=sys.stderr)
    if running is not None:
        await running.stop()
    await asyncio.to_thread(shutdown)
    print("stopped", file=sys.stderr)
    return 0
