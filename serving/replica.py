"""The engine as a Ray Serve deployment: each replica owns a device, the model, the KV cache and the
engine loop, and streams each request's deltas back through ``DeploymentHandle.options(stream=True)``.

A caller that stops consuming (client cancelled, deadline passed) cancels the replica's generator;
its ``finally`` aborts the request in the engine, so KV blocks are freed at the next step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Deployment
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from protocol.engine_config import EngineConfig
from protocol.model_info import ModelInfo
from protocol.requests import EngineDeadError, GenerationRequest, RequestOutput
from protocol.stats import EngineStats
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


class EngineReplica:
    """One engine replica (a Ray actor managed by Serve)."""

    def __init__(self, engine_config: EngineConfig, pool: str) -> None:
        self.pool = pool
        # The engine is imported here, in the replica's process: whoever only builds the deployment
        # (loom serve's gateway, build_app) never loads torch.
        from worker.api import AsyncEngine, LLMEngine

        self.engine: AsyncEngine = AsyncEngine(LLMEngine(engine_config)).start()
        self.info = self.engine.engine.model_info(pool)
        log.info("engine replica ready: %s", self.info)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        # Closing this generator closes the engine's stream at once, which aborts the request.
        async with contextlib.aclosing(self.engine.generate(request)) as stream:
            async for out in stream:
                yield out

    async def model_info(self) -> ModelInfo:
        return self.info

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

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
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)


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
        )
    else:
        options["num_replicas"] = num_replicas
    deployment: Deployment = serve.deployment(**options)(EngineReplica)
    return deployment.bind(engine_config, pool)
