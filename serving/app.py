"""Builds Loom's Ray Serve applications: engine pools, and the gateway in front of them.

``loom serve`` uses these to deploy on a local Ray; KubeRay's RayService imports ``serving.app:build_app``
(``serveConfigV2.applications[].import_path``) with the same settings from environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from ray import serve

from gateway.settings import GatewaySettings
from protocol.engine_config import EngineConfig
from serving.ingress import gateway_deployment
from serving.replica import engine_deployment
from tenancy import TenancySettings
from tenancy.models import SHARED_POOL


class PoolSpec(BaseModel):
    """One engine deployment: a pool of replicas serving one model."""

    name: str = SHARED_POOL
    replicas: int = Field(1, ge=1)
    autoscale: bool = False
    max_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    # Ray custom resources each replica needs, e.g. {"loom_engine": 1}: only nodes started with them
    # (the engine worker group on KubeRay) take replicas, as GPUs would place them.
    resources: dict[str, float] = Field(default_factory=dict)
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @property
    def deployment_name(self) -> str:
        return f"engine-{self.name}"


def engine_app(pool: PoolSpec) -> serve.Application:
    return engine_deployment(
        pool.engine,
        name=pool.deployment_name,
        pool=pool.name,
        num_replicas=pool.replicas,
        min_replicas=pool.replicas,
        max_replicas=max(pool.max_replicas, pool.replicas),
        autoscale=pool.autoscale,
        num_cpus=pool.num_cpus,
        num_gpus=pool.num_gpus,
        resources=pool.resources or None,
    )


def model_path(pool: PoolSpec) -> str | None:
    return str(Path(pool.engine.model_path).resolve()) if pool.engine.model_path else None


def portable_tenancy(settings: TenancySettings) -> TenancySettings:
    """Absolute paths, so a replica started in another working directory finds the same files."""
    return settings.model_copy(
        update={
            "tenants_file": settings.tenants_file.resolve(),
            "secret_file": settings.secret_file.resolve(),
        }
    )


def gateway_app(
    pools: list[PoolSpec],
    gateway: GatewaySettings,
    tenancy: TenancySettings,
    replicas: int = 1,
    resources: dict[str, float] | None = None,
) -> serve.Application:
    """The gateway deployment bound to one engine deployment per pool."""
    return gateway_deployment(
        gateway,
        portable_tenancy(tenancy),
        {p.name: engine_app(p) for p in pools},
        {p.name: model_path(p) for p in pools},
        num_replicas=replicas,
        resources=resources,
    )


def build_app(args: dict[str, Any]) -> serve.Application:
    """RayService entry point. ``args``: {"pools": [PoolSpec fields...], "gateway_replicas": n,
    "gateway_resources": {"loom_gateway": 1}} (a pool's ``resources``, e.g. {"loom_engine": 1}, place
    its replicas on the engine nodes); gateway and tenancy settings come from the
    LOOM_GATEWAY_* / LOOM_TENANCY_* environment variables of the pods."""
    pools = [PoolSpec(**p) for p in args.get("pools", [{}])]
    return gateway_app(
        pools,
        GatewaySettings(),
        TenancySettings(),
        int(args.get("gateway_replicas", 1)),
        args.get("gateway_resources"),
    )
