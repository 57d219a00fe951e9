"""``loom serve``: Ray locally, engine replicas as a Serve deployment, the gRPC gateway in front.

By default the gateway runs in this process; ``--gateway-in-serve`` deploys it as a Serve deployment
instead (how it runs on KubeRay). Ctrl-C (or SIGTERM) drains the gateway and shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

from tenancy.models import SHARED_POOL
from worker.api import EngineConfig

log = logging.getLogger("loom.serve")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the gRPC API: Ray Serve engine replicas behind the gateway")
    # Unset flags fall back to GatewaySettings (LOOM_GATEWAY_* variables, then its defaults).
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default 50051)")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (default 8000)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only, no OpenAI-compatible HTTP front")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default 9464)")
    p.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the embedded model)")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas in the shared pool")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale the shared pool up to this many")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per engine replica")
    p.add_argument("--dedicated-pool", action="append", default=[], help="also deploy a dedicated pool NAME")
    p.add_argument(
        "--redis-url", default=None, help="use the Redis tenant store (default: .loom/tenants.yaml)"
    )
    p.add_argument("--gateway-in-serve", action="store_true", help="run the gateway as a Serve deployment")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    p.set_defaults(func=run)


def start_ray(address: str | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    # A fresh local cluster on ports that do not collide with Redis; no dashboard, quiet workers.
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # ray.init picks a free GCS port for a local cluster (only `ray start --head` defaults to 6379).
    ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


def start_serve() -> None:
    from ray import serve
    from ray.serve.config import ProxyLocation

    serve.start(proxy_location=ProxyLocation.Disabled, http_options={"host": "127.0.0.1", "port": 0})


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
    demo_key = bootstrap_embedded(tenancy) if tenancy.store == "file" else None
    try:
        return asyncio.run(_serve(args, gateway, tenancy, demo_key))
    except KeyboardInterrupt:
        return 0


async def _serve(
    args: argparse.Namespace, gateway: object, tenancy_settings: object, demo_key: str | None
) -> int:
    import ray
    from ray import serve

    from gateway.catalog import ModelCatalog
    from gateway.pools import ServeEnginePool
    from gateway.server import GatewayServer
    from loom.app import PoolSpec, engine_app, gateway_app, tokenizer_path
    from tenancy import Tenancy
    from worker.api import load_tokenizer, process_registry

    started = time.monotonic()
    engine = EngineConfig(model_path=args.model) if args.model else EngineConfig()
    pools = [
        PoolSpec(
            name=name,
            replicas=args.replicas,
            autoscale=args.max_replicas is not None,
            max_replicas=args.max_replicas or args.replicas,
            num_cpus=args.replica_cpus,
            engine=engine,
        )
        for name in [SHARED_POOL, *args.dedicated_pool]
    ]
    print("starting Ray and the engine replicas (the first start takes about a minute) ...", file=sys.stderr)
    await asyncio.to_thread(start_ray, args.ray_address)
    await asyncio.to_thread(start_serve)

    server = None
    tenancy = None
    if args.gateway_in_serve:
        app = gateway_app(pools, gateway, tenancy_settings)  # type: ignore[arg-type]
        handle = await asyncio.to_thread(serve.run, app, name="loom", route_prefix=None)
        address = await handle.address.remote()
        http_address = await handle.http_address.remote()
    else:
        handles = {}
        for p in pools:
            handles[p.name] = await asyncio.to_thread(
                serve.run, engine_app(p), name=p.deployment_name, route_prefix=None
            )
        tokenizers = {p.name: await asyncio.to_thread(load_tokenizer, tokenizer_path(p)) for p in pools}
        tenancy = Tenancy.from_settings(tenancy_settings)  # type: ignore[arg-type]
        await tenancy.start()
        catalog = await ModelCatalog.build(
            [(ServeEnginePool(h, name, process_registry()), tokenizers[name]) for name, h in handles.items()]
        )
        server = await GatewayServer(gateway, tenancy, catalog).start()  # type: ignore[arg-type]
        address = server.address
        http_address = server.http_address
    print(f"ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(_banner(address, http_address, demo_key, bool(args.tls_cert)), flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("\nshutting down: draining streams ...", file=sys.stderr)
    if server is not None:
        await server.stop()
    if tenancy is not None:
        await tenancy.stop()
    with contextlib.suppress(Exception):
        await asyncio.to_thread(serve.shutdown)
    await asyncio.to_thread(ray.shutdown)
    print("stopped", file=sys.stderr)
    return 0
