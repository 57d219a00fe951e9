"""Where the gateway sends a request: a pool of engine replicas serving one model.

``ServeEnginePool`` dispatches into a Ray Serve deployment of engine replicas through a streaming
DeploymentHandle (the production path; Loom's request router picks the replica).
``LocalEnginePool`` runs an engine in the gateway's own process (single-process tools and benchmarks).
Both stream ``RequestOutput`` deltas and stop the request in the engine when the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from tenancy.models import SHARED_POOL
from worker.api import AsyncEngine, EngineStats, GenerationRequest, ReplicaStatsRegistry, RequestOutput

log = logging.getLogger(__name__)


class WorkerLostError(RuntimeError):
    """The replica serving a request died or became unreachable."""


@dataclass(frozen=True)
class PoolModel:
    """What a pool serves, as reported by its replicas."""

    model: str
    context_length: int
    vocab_size: int


class EnginePool(Protocol):
    name: str

    async def describe(self) -> PoolModel: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]: ...

    def replica_stats(self) -> dict[str, EngineStats]: ...


class LocalEnginePool:
    def __init__(self, engine: AsyncEngine, name: str = SHARED_POOL) -> None:
        self.name = name
        self.engine = engine

    async def describe(self) -> PoolModel:
        core = self.engine.engine
        return PoolModel(core.model_name, core.max_model_len, core.model_config.vocab_size)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        # Closing this generator closes the engine's stream at once, which aborts the request.
        async with contextlib.aclosing(self.engine.generate(request)) as stream:
            async for out in stream:
                yield out

    def replica_stats(self) -> dict[str, EngineStats]:
        return {"local": self.engine.stats()}


class ServeEnginePool:
    """A Ray Serve deployment of ``worker.serve_engine.EngineReplica``."""

    # A replica lost before the first delta is retried on another replica (or its replacement);
    # after output has been streamed the request fails with UNAVAILABLE, its usage counted.
    RETRIES_BEFORE_OUTPUT = 2

    def __init__(self, handle: Any, name: str, stats: ReplicaStatsRegistry) -> None:
        self.name = name
        self._stats = stats
        self.deployment = f"{handle.app_name}/{handle.deployment_name}"
        self._handle = handle
        self._stream = handle.options(stream=True)

    async def describe(self) -> PoolModel:
        info = await self._handle.model_info.remote()
        return PoolModel(info["model"], int(info["context_length"]), int(info["vocab_size"]))

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        import ray.exceptions
        from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

        lost = (ray.exceptions.RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
        attempt = 0
        while True:
            response = self._stream.generate.remote(request)
            delivered = False
            finished = False
            try:
                async for out in response:
                    delivered = True
                    finished = out.finished
                    yield out
                return
            except lost as exc:
                if not delivered and attempt < self.RETRIES_BEFORE_OUTPUT:
                    attempt += 1
                    await asyncio.sleep(0.5 * attempt)  # let Serve mark the replica dead or replace it
                    log.warning(
                        "replica lost before output (%s); retrying request %s", exc, request.request_id
                    )
                    continue
                raise WorkerLostError(f"the engine replica serving this request was lost: {exc}") from exc
            finally:
                if not finished:
                    response.cancel()  # the replica's generator is cancelled: it aborts the request

    def replica_stats(self) -> dict[str, EngineStats]:
        return self._stats.replicas(self.deployment)
