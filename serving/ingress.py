"""The gateway as a Ray Serve deployment: each replica starts the same grpc.aio server on a configured
port (on KubeRay, one gateway replica per pod behind a Kubernetes Service).

Serve hands the replica a DeploymentHandle per engine pool; everything else is the code path
``loom serve`` runs in-process.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from ray import serve
from ray.serve.handle import DeploymentHandle

from gateway.settings import GatewaySettings
from serving.bootstrap import RunningGateway, serve_route, start_gateway
from tenancy import TenancySettings

log = logging.getLogger(__name__)


class GatewayIngress:
    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        gateway_settings: GatewaySettings,
        tenancy_settings: dict[str, Any],  # TenancySettings without its secrets (see gateway_deployment)
        pools: dict[str, DeploymentHandle[Any]],
        model_paths: dict[str, str | None],  # pool -> model path (None: the embedded model)
    ) -> None:
        tenancy = TenancySettings(**tenancy_settings)  # this replica's environment supplies the secrets
        routes = [serve_route(h, name, model_paths[name]) for name, h in pools.items()]
        self.gateway: RunningGateway = await start_gateway(gateway_settings, tenancy, routes)

    async def address(self) -> str:
        return self.gateway.server.address

    async def http_address(self) -> str | None:
        return self.gateway.server.http_address

    def check_health(self) -> None:
        if self.gateway.server.port is None:
            raise RuntimeError("the gRPC server is not running")

    async def __del__(self) -> None:
        await self.gateway.stop()


GATEWAY_CPUS = 0.5  # a gateway replica's Ray reservation: its loop is mostly waiting on sockets


def gateway_deployment(
    gateway_settings: GatewaySettings,
    tenancy_settings: TenancySettings,
    pools: dict[str, serve.Application],
    model_paths: dict[str, str | None],
    *,
    name: str = "gateway",
    num_replicas: int = 1,
    num_cpus: float = GATEWAY_CPUS,
    resources: dict[str, float] | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> serve.Application:
    """A bound Serve application of gateway replicas in front of the given engine applications.

    Secrets (``LOOM_TENANCY_SECRET``) reach replicas through their environment: the pod's on KubeRay,
    or ``runtime_env`` here; they are never part of the deployment's arguments.
    """
    actor_options: dict[str, Any] = {"num_cpus": num_cpus}
    if resources:  # e.g. {"loom_gateway": 1}: one replica per gateway pod on KubeRay
        actor_options["resources"] = resources
    if runtime_env:
        actor_options["runtime_env"] = runtime_env
    deployment: serve.Deployment = serve.deployment(
        name=name,
        num_replicas=num_replicas,
        ray_actor_options=actor_options,
        graceful_shutdown_timeout_s=gateway_settings.drain_grace_s + 5,
    )(GatewayIngress)
    # Tenancy's secrets stay out (see _secrets): each replica's environment supplies them.
    public = tenancy_settings.model_dump(mode="json", exclude=_secrets(tenancy_settings))
    return deployment.bind(gateway_settings, public, pools, model_paths)


def _secrets(settings: TenancySettings) -> set[str]:
    """Tenancy fields that must not travel in deployment arguments (Ray keeps those in its GCS): the
    key-hashing secrets, and a Redis URL that carries a password. Replicas read them from their own
    environment (``LOOM_TENANCY_*``: the pod's, from a Kubernetes Secret)."""
    fields = {"secret", "previous_secrets", "redis_password"}
    if urlparse(str(settings.redis_url)).password:
        fields.add("redis_url")
    return fields
