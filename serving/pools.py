"""The engine pools the gateway dispatches into (the ``gateway.engine_pool.EnginePool`` seam).

``ServeEnginePool`` dispatches into a Ray Serve deployment of engine replicas through a streaming
``DeploymentHandle`` (the production path; Loom's request router picks the replica).
``LocalEnginePool`` runs an engine in the gateway's own process (single-process tools and benchmarks).
Both stream ``RequestOutput`` deltas and stop the request in the engine when the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, cast

import ray.exceptions
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from gateway.engine_pool import WorkerLostError
from protocol.model_info import ModelInfo
from protocol.requests import EngineDeadError, FinishReason, GenerationRequest, RequestOutput
from protocol.stats import EngineStats
from serving.replica_stats import ReplicaStatsRegistry
from tenancy.models import SHARED_POOL

if TYPE_CHECKING:  # a gateway process never loads the engine: only LocalEnginePool's callers do
    from worker.api import AsyncEngine

log = logging.getLogger(__name__)

# What losing a replica looks like from a DeploymentHandle's stream.
_LOST = (ray.exceptions.RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, EngineDeadError)


class LocalEnginePool:
    def __init__(self, engine: AsyncEngine, name: str = SHARED_POOL) -> None:
        self.name = name
        self.engine = engine

    async def describe(self) -> ModelInfo:
        return self.engine.engine.model_info(pool=self.name)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        # Closing this generator closes the engine's stream at once, which aborts the request.
        async with contextlib.aclosing(self.engine.generate(request)) as stream:
            async for out in stream:
                yield out

    def replica_stats(self) -> dict[str, EngineStats]:
        return {"local": self.engine.stats()}


class ServeEnginePool:
    """A Ray Serve deployment of ``serving.replica.EngineReplica``."""

    # A replica lost (or whose engine died) before the first delta is retried on another replica (or
    # its replacement); after output has been streamed it is WorkerLostError, which resume.py continues.
    RETRIES_BEFORE_OUTPUT = 2
    # A request whose engine failed it before its first token (a forward pass that raised) is retried
    # once elsewhere: the router ranks the replica that failed it last.
    RETRIES_AFTER_ENGINE_ERROR = 1

    def __init__(self, handle: DeploymentHandle[Any], name: str, stats: ReplicaStatsRegistry) -> None:
        self.name = name
        self._stats = stats
        self.deployment = f"{handle.app_name}/{handle.deployment_name}"
        self._handle = handle
        self._stream = handle.options(stream=True)

    async def describe(self) -> ModelInfo:
        info: ModelInfo = await self._handle.model_info.remote()
        return info

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        losses = errors = 0
        current = request
        while True:
            # A handle with stream=True answers a generator (its type cannot say so).
            response = cast(DeploymentResponseGenerator[RequestOutput], self._stream.generate.remote(current))
            delivered = False
            finished = False
            retry = False
            try:
                async for out in response:
                    failed_first = not delivered and out.finish_reason is FinishReason.ERROR
                    if failed_first and errors < self.RETRIES_AFTER_ENGINE_ERROR:
                        errors += 1
                        finished = retry = True
                        log.warning(
                            "engine failed request %s before output; retrying elsewhere", request.request_id
                        )
                        break
                    delivered = True
                    finished = out.finished
                    yield out
                if not retry:
                    return
            except _LOST as exc:
                if delivered or losses >= self.RETRIES_BEFORE_OUTPUT:
                    log.warning("request %s lost its replica: %s", request.request_id, exc)
                    raise WorkerLostError("the engine replica serving this request was lost") from exc
                losses += 1
                await asyncio.sleep(0.5 * losses)  # let Serve mark the replica dead or replace it
                log.warning("replica lost before output (%s); retrying request %s", exc, request.request_id)
            finally:
                if not finished:
                    response.cancel()  # type: ignore[no-untyped-call]  # the replica's generator is cancelled: it aborts the request
            attempt = losses + errors
            current = dataclasses.replace(
                request, request_id=f"{request.request_id}#retry{attempt}", retry_of=current.request_id
            )

    def replica_stats(self) -> dict[str, EngineStats]:
        return self._stats.replicas(self.deployment)
