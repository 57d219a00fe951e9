"""The engine pools the gateway dispatches into (the ``gateway.engine_pool.EnginePool`` seam).

``ServeEnginePool`` dispatches into a Ray Serve deployment of engine replicas through a
``DeploymentHandle`` (the production path; Loom's request router picks the replica), a call per
request or per burst of requests (serving/dispatch.py), whose deltas come back in bulk on this
process's stream from that replica (serving/delta_streams.py).
``LocalEnginePool`` runs an engine in the gateway's own process (single-process tools and benchmarks).
Both stream ``RequestOutput`` deltas and stop the request in the engine when the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import ray.exceptions
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from gateway.engine_pool import WorkerLostError
from protocol.model_info import ModelInfo
from protocol.requests import EngineDeadError, FinishReason, GenerationRequest, RequestOutput
from protocol.stats import EngineStats
from serving.delta_streams import CALL_ENDED, DeltaStreams, Item
from serving.dispatch import Dispatcher
from serving.pinning import ReplicaGoneError
from serving.replica_stats import ReplicaStatsRegistry
from tenancy.models import SHARED_POOL

if TYPE_CHECKING:  # a gateway process never loads the engine: only LocalEnginePool's callers do
    from worker.api import AsyncEngine

log = logging.getLogger(__name__)


class DeltasLostError(RuntimeError):
    """A request's call ended but its final delta never came (its replica's stream broke)."""


# What losing a replica looks like from a DeploymentHandle's call or stream.
_LOST = (
    ray.exceptions.RayActorError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
    EngineDeadError,
    DeltasLostError,
    ReplicaGoneError,
)
# After a request's call has returned, its final delta is on its way; this long without it, the
# stream that should carry it is lost.
FINAL_DELTA_GRACE_S = 10.0


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

    async def close(self) -> None:
        """The engine is its owner's to stop."""


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
        self._deltas = DeltaStreams(handle, self.deployment, stats)
        self._dispatch = Dispatcher(handle, self._deltas.subscriber)
        self._deltas.on_routed = self._dispatch.routed

    async def describe(self) -> ModelInfo:
        info: ModelInfo = await self._handle.model_info.remote()
        return info

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        losses = errors = 0
        current = request
        while True:
            queue = self._deltas.open(current.request_id)
            # A call that returns once the request has ended (Serve counts it ongoing meanwhile).
            outcome = self._dispatch.submit(current)
            outcome.add_done_callback(functools.partial(_call_ended, queue))
            delivered = False
            finished = False
            retry = False
            call_ended = False
            try:
                while not finished:
                    if call_ended:
                        item = await _final(queue)
                    else:
                        item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if not isinstance(item, RequestOutput):  # CALL_ENDED
                        call_ended = True
                        continue
                    out = item
                    failed_first = (
                        not delivered and out.finish_reason is FinishReason.ERROR and not out.request_fault
                    )
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
                # Unfinished: the request is aborted on its replica (a cancel of the call alone does
                # not reach the replica while its call waits without yielding).
                self._deltas.release(current.request_id, abort=not finished)
                if not finished:
                    self._dispatch.give_up(current.request_id)
            attempt = losses + errors
            current = dataclasses.replace(
                request, request_id=f"{request.request_id}#retry{attempt}", retry_of=current.request_id
            )

    def replica_stats(self) -> dict[str, EngineStats]:
        return self._stats.replicas(self.deployment)

    async def close(self) -> None:
        """Close the delta streams while Ray is up (a stream read after Ray's shutdown ends the process)."""
        await self._dispatch.close()
        await self._deltas.close()


def _call_ended(queue: asyncio.Queue[Item], outcome: asyncio.Future[None]) -> None:
    """How the request's call ended, into its queue: an error (refused, replica lost) or done."""
    if outcome.cancelled():  # given up: nobody reads the queue any more
        return
    error = outcome.exception()
    queue.put_nowait(CALL_ENDED if error is None else error)


async def _final(queue: asyncio.Queue[Item]) -> Item:
    try:
        async with asyncio.timeout(FINAL_DELTA_GRACE_S):
            return await queue.get()
    except TimeoutError:
        raise DeltasLostError(f"no final delta {FINAL_DELTA_GRACE_S:g} s after the call ended") from None
