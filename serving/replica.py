"""The engine as a Ray Serve deployment: each replica owns a device, the model, the KV cache and the
engine loop.

Requests come in calls, ``generate(requests, subscriber)`` (one request, or a gateway's burst:
serving/dispatch.py), open while they run (so Serve counts them ongoing: routing and draining see
the load; the autoscaler reads the requests themselves); their deltas travel in
bulk on the subscriber's stream, ``deltas``, which carries every request of that gateway process on
this replica (serving/outbox.py). A caller that cancels the call (client gone, deadline passed)
aborts the request in the engine, so its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Deployment
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.exceptions import RayServeException

from protocol.engine_config import EngineConfig
from protocol.model_info import ModelInfo
from protocol.requests import EngineDeadError, GenerationRequest, RequestOutput
from protocol.stats import EngineStats
from serving import start_phases
from serving.autoscaling import ENGINE_REQUESTS_METRIC, POLICY
from serving.outbox import Outboxes, RequestFailed
from serving.pinning import Pinned, ReplicaGoneError
from serving.replica_stats import UNHEALTHY_AFTER_FAILED_STEPS
from serving.router import ROUTER_CLASS

if TYPE_CHECKING:
    from worker.api import AsyncEngine

log = logging.getLogger(__name__)

# Requests wait in the engine's priority scheduler, never in Serve's FIFO queue in front of it:
# a replica accepts every request it is sent (up to this many), so an interactive request is never
# stuck behind a backlog of batch work that Serve is holding back.
MAX_ONGOING_REQUESTS = 4096
ROUTING_STATS_PERIOD_S = 1.0
SWEEP_PERIOD_S = 5.0  # how often requests of subscribers gone for good are looked for
LEDGER_PERIOD_S = 1.0  # how often a replica shares its fair-share service with the pool's others


class EngineReplica:
    """One engine replica (a Ray actor managed by Serve)."""

    def __init__(self, engine_config: EngineConfig, pool: str) -> None:
        self.pool = pool
        deployment, replica = _whoami()
        self.replica_id = replica
        start_phases.report(deployment, replica, "importing torch and the engine")
        # The engine is imported here, in the replica's process: whoever only builds the deployment
        # (loom serve's gateway, build_app) never loads torch.
        from worker.api import AsyncEngine, LLMEngine

        start_phases.report(
            deployment,
            replica,
            "loading the model and the compiled CPU kernels (a first build takes minutes)",
        )
        # Built on its loop's thread (AsyncEngine.launch says why).
        self.engine: AsyncEngine = AsyncEngine.launch(lambda: LLMEngine(engine_config))
        self.info = self.engine.engine.model_info(pool)
        start_phases.report(deployment, replica, "ready")
        self._outboxes = Outboxes(self.engine.abort, engine_config.stream_interval)
        self._sweeper: asyncio.Task[None] | None = None
        self._live_requests = 0  # in calls still open (a call carries one request or several)
        self._ledger_name = _ledger_name()
        log.info("engine replica ready: %s", self.info)

    async def generate(self, requests: list[GenerationRequest], subscriber: str) -> None:
        """Run ``requests`` (one gateway's, sent together) until each has ended; their deltas go to
        ``subscriber``'s stream (``deltas``), and so does the error of one the engine refuses or
        fails (``RequestFailed``): the others of the call run on.

        A call that returns nothing once its requests have ended (Serve counts it ongoing meanwhile;
        a unary call costs Ray less than a stream of no items); a caller that gives one up calls
        ``abort`` (pinned to this replica), and cancels the call once it has given up all of them.
        """
        box = self._outboxes.of(subscriber)
        ends = []
        for request in requests:
            ends.append(box.track(request.request_id))
            try:
                self.engine.submit(request, box)
            except Exception as exc:  # InvalidRequestError, EngineDeadError: this request's alone
                box.fail(request.request_id, exc)
        self._live_requests += len(requests)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())
            if self._ledger_name is not None:
                self._ledger_task = asyncio.create_task(self._share_service(self._ledger_name))
        try:
            await asyncio.gather(*ends)
        finally:
            self._live_requests -= len(requests)
            for request, end in zip(requests, ends, strict=True):
                if not end.done():  # cancelled: the caller went away
                    box.untrack(request.request_id)
                    self.engine.abort(request.request_id)

    async def deltas(self, pinned: Pinned) -> AsyncIterator[list[RequestOutput | RequestFailed]]:
        """The subscriber's stream on this replica: an empty batch once open, then every delta owed
        to it, many requests' per item; it ends when nothing is owed or live for a while."""
        self._check_pin(pinned)
        async for batch in self._outboxes.of(pinned.subscriber).stream():
            yield batch

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            aborted = self._outboxes.sweep()
            if aborted:
                log.warning("aborted %d requests whose gateway holds no stream any more", len(aborted))

    async def _share_service(self, name: str) -> None:
        """Every second, this replica's fair-share service to the pool's ledger and the other
        replicas' back into the engine's counters: tenants are served fairly across the pool, not
        replica by replica (worker/fair_share.py). Unreachable, the replica stays fair on its own."""
        from serving.ledger import pool_ledger

        ledger = None
        engine = self.engine.engine
        while True:
            await asyncio.sleep(LEDGER_PERIOD_S)
            try:
                ledger = ledger or pool_ledger(name)
                engine.set_remote_service(await ledger.report.remote(self.replica_id, engine.fair_service()))
            except Exception as exc:
                ledger = None
                log.warning(
                    "the pool's service ledger is unreachable (%s): fair share per replica meanwhile", exc
                )

    async def model_info(self) -> ModelInfo:
        return self.info

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def abort(self, pinned: Pinned, request_id: str) -> None:
        """Stop a request its caller gave up on (pinned here: a call's cancel does not reach a call
        that is waiting, not yielding)."""
        self._check_pin(pinned)
        self.engine.abort(request_id)

    def _check_pin(self, pinned: Pinned) -> None:
        if pinned.replica_id != self.replica_id:
            raise ReplicaGoneError(f"replica {pinned.replica_id} is gone (this is {self.replica_id})")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The requests this replica runs, for the autoscaler (serving/autoscaling.py): Serve's own
        count is of calls, and a call carries several requests in a burst."""
        return {ENGINE_REQUESTS_METRIC: float(self._live_requests)}

    def record_routing_stats(self) -> dict[str, Any]:
        """Published to the request router (Serve's channel carries plain dicts)."""
        return self.engine.stats().to_dict()

    def check_health(self) -> None:
        """Serve replaces a replica whose engine loop died or whose forward passes keep failing."""
        if not self.engine.alive:
            raise EngineDeadError("the engine loop is not running")
        failing = self.engine.stats().consecutive_failed_steps
        if failing >= UNHEALTHY_AFTER_FAILED_STEPS:
            raise EngineDeadError(f"the last {failing} forward passes failed")

    def __del__(self) -> None:
        for task in (getattr(self, "_sweeper", None), getattr(self, "_ledger_task", None)):
            if task is not None:
                task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


def _ledger_name() -> str | None:
    """The name the deployment's ledger goes by (application and deployment); None outside Serve."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return None
    return f"{context.app_name}/{context.deployment}"


def _whoami() -> tuple[str, str]:
    """(deployment, replica id) inside Serve; built outside it (a test, a tool), a local stand-in."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return "local", "local"
    return context.deployment, context.replica_id.unique_id


def engine_deployment(
    engine_config: EngineConfig,
    *,
    name: str = "engine",
    pool: str,
    num_replicas: int | str = 1,
    min_replicas: int = 1,
    max_replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    autoscale: bool = False,
    target_ongoing_requests: float = 64.0,
) -> serve.Application:
    """A bound Serve application of engine replicas, routed by Loom's request router.

    With ``autoscale``, replicas are added when their ongoing requests exceed
    ``target_ongoing_requests`` on average (a replica's batch size is the natural unit).
    ``resources`` (Ray custom resources, e.g. ``{"loom_engine": 1}``) pin replicas to the nodes that
    offer them: on KubeRay, the engine worker pods, never the head or the gateway pods.
    """
    actor_options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        actor_options["resources"] = dict(resources)
    options: dict[str, Any] = dict(
        name=name,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        ray_actor_options=actor_options,
        request_router_config=RequestRouterConfig.model_validate(
            {
                "request_router_class": ROUTER_CLASS,
                "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                "request_routing_stats_timeout_s": 5.0,
            }
        ),
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=30.0,
    )
    if autoscale:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            policy=AutoscalingPolicy.model_validate({"policy_function": POLICY}),
        )
    else:
        options["num_replicas"] = num_replicas
    deployment: Deployment = serve.deployment(**options)(EngineReplica)
    return deployment.bind(engine_config, pool)
