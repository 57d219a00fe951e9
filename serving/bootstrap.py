"""Starting Loom: a local Ray with Serve, and the gateway in front of engine pools, built one way.

``loom serve`` (gateway in its own process), the gateway's Serve deployment (serving/ingress.py, as on
KubeRay), the tests and the benchmarks all start a gateway through :func:`start_gateway`: tenancy
started from its settings, each pool's model asked of the pool and paired with its tokenizer (read
off the event loop: a 1 MB tokenizer file takes a while), the gRPC and HTTP fronts listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from gateway.catalog import ModelCatalog
from gateway.engine_pool import EnginePool
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from protocol.model_files import load_tokenizer
from protocol.tokenizer import Tokenizer
from serving.pools import ServeEnginePool
from serving.replica_stats import process_registry
from tenancy import Tenancy, TenancySettings


@dataclass(frozen=True)
class PoolRoute:
    """A pool the gateway dispatches into and where its model's tokenizer comes from."""

    pool: EnginePool
    model_path: str | Path | None  # a .gguf file or a Hugging Face directory; None: the embedded model


def serve_route(handle: DeploymentHandle[Any], pool: str, model_path: str | Path | None) -> PoolRoute:
    """A route into a Serve deployment of engine replicas (serving/replica.py)."""
    return PoolRoute(ServeEnginePool(handle, pool, process_registry()), model_path)


@dataclass
class RunningGateway:
    server: GatewayServer
    tenancy: Tenancy

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain the fronts (up to the grace period), then stop tenancy's watchers and connections."""
        try:
            await self.server.stop(grace_s)
        finally:
            await self.tenancy.stop()


async def start_gateway(
    settings: GatewaySettings, tenancy: TenancySettings | Tenancy, routes: Sequence[PoolRoute]
) -> RunningGateway:
    """The gateway serving ``routes``; ``tenancy`` is started here when given as settings."""
    if isinstance(tenancy, TenancySettings):
        tenancy = Tenancy.from_settings(tenancy)
        await tenancy.start()
    try:
        tokenizers = [await asyncio.to_thread(_warm_tokenizer, r.model_path) for r in routes]
        catalog = await ModelCatalog.build([(r.pool, tok) for r, tok in zip(routes, tokenizers, strict=True)])
        server = await GatewayServer(settings, tenancy, catalog).start()
    except BaseException:
        await tenancy.stop()
        raise
    return RunningGateway(server, tenancy)


def _warm_tokenizer(path: str | Path | None) -> Tokenizer:
    return load_tokenizer(path).warm()


@contextlib.asynccontextmanager
async def running_gateway(
    settings: GatewaySettings, tenancy: TenancySettings | Tenancy, routes: Sequence[PoolRoute]
) -> AsyncIterator[RunningGateway]:
    gateway = await start_gateway(settings, tenancy, routes)
    try:
        yield gateway
    finally:
        await gateway.stop(grace_s=0)


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join ``address``, or start a local Ray (no dashboard, quiet workers) on ports clear of Redis's."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # ray.init picks a free GCS port for a local cluster (only `ray start --head` defaults to 6379).
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


def start_serve() -> None:
    """Serve without its own HTTP proxy: Loom's gateway is the only front (port 8000 is the OpenAI API)."""
    from ray import serve
    from ray.serve.config import ProxyLocation

    serve.start(proxy_location=ProxyLocation.Disabled, http_options={"host": "127.0.0.1", "port": 0})


def deploy(app: Application, name: str) -> DeploymentHandle[Any]:
    """Run a Serve application (blocking until its replicas are up) and return its ingress handle."""
    from ray import serve

    return serve.run(app, name=name, route_prefix=None)


def shutdown() -> None:
    """Stop Serve's applications, then this process's Ray (a local cluster stops with it)."""
    import ray
    from ray import serve

    with contextlib.suppress(Exception):
        serve.shutdown()  # type: ignore[no-untyped-call]
    ray.shutdown()
