"""Gateway fixtures: one real Ray + Serve per session, real engine replicas (a tiny random model and
the embedded SmolLM2), the real gateway over a loopback socket, tenants in the real Redis."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY

import serving.bootstrap
from gateway.grpc.client import LoomClient
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from protocol.engine_config import EngineConfig
from serving.app import PoolSpec, engine_app
from serving.bootstrap import running_gateway, serve_route, start_ray, start_serve
from tenancy import RedisTenantStore, Tenancy, TenancySettings
from tenancy.models import Quotas, Tenant
from tests.helpers import eventually

SECRET = "gateway-test-secret-0123456789abcdef"
TINY = "tiny"
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[None]:
    import ray
    from ray import serve

    # Logical CPUs: replicas reserve them for scheduling; the 2 real cores are shared anyway.
    start_ray(num_cpus=8)
    start_serve()
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf_dir(random_checkpoint(), tmp_path_factory.mktemp("models") / TINY)


def _tiny_engine(tiny_dir: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model_path=str(tiny_dir), block_size=8, kv_cache_memory_mb=8, max_num_seqs=4, num_threads=1
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="session")
def engine_handles(ray_serve: None, tiny_dir: Path) -> dict[str, Any]:
    """Deployments: tiny (shared), smol (shared), vip (a dedicated pool), fragile (for kill tests)."""
    specs = {
        "tiny": PoolSpec(name="shared", engine=_tiny_engine(tiny_dir)),
        "smol": PoolSpec(
            name="shared", engine=EngineConfig(kv_cache_memory_mb=64, num_threads=1, max_num_seqs=8)
        ),
        "vip": PoolSpec(name="vip", engine=_tiny_engine(tiny_dir)),
    }
    handles = {}
    for key, spec in specs.items():
        from ray import serve

        handles[key] = serve.run(engine_app(spec), name=f"engine-{key}", route_prefix=None)
    return handles


@pytest.fixture(scope="session")
def tenancy_settings(redis_url: str) -> Iterator[TenancySettings]:
    prefix = f"loomgw-{uuid.uuid4().hex[:8]}"
    yield TenancySettings(
        store="redis",
        redis_url=redis_url,
        key_prefix=prefix,
        secret=SECRET,
        resync_interval_s=1.0,
        redis_timeout_s=2.0,  # a loaded 2-core machine must not flip admission into its local fallback
    )
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


@dataclass
class Gateway:
    server: GatewayServer
    tenancy: Tenancy
    store: RedisTenantStore
    handles: dict[str, Any]

    @property
    def address(self) -> str:
        return self.server.address

    async def tenant(self, *, models: tuple[str, ...] = ("*",), **fields: Any) -> tuple[Tenant, str]:
        """A fresh tenant (unlimited unless quotas are given) and an API key the gateway already knows."""
        quotas = Quotas.unlimited().model_copy(update=fields.pop("quotas", {}))
        tenant = Tenant(id=f"t-{uuid.uuid4().hex[:10]}", quotas=quotas, allowed_models=list(models), **fields)
        self.store.create_tenant(tenant, actor="tests")
        key = self.store.create_key(tenant.id, actor="tests").plaintext.get_secret_value()
        await eventually(lambda: self._knows(key), timeout_s=20)
        return tenant, key

    def _knows(self, key: str) -> bool:
        try:
            self.tenancy.authenticate(key)
            return True
        except Exception:
            return False

    def refusals(self, tenant_id: str, reason: str) -> float:
        """The gateway's count of this tenant's refusals for ``reason`` (it runs in this process)."""
        labels = {"tenant": tenant_id, "reason": reason}
        return REGISTRY.get_sample_value("loom:gateway_admission_refusals_total", labels) or 0.0

    def client(self, key: str | None) -> LoomClient:
        return LoomClient(self.address, key)

    def openai(self, key: str) -> Any:
        """The official OpenAI SDK pointed at the gateway's HTTP front (no retries: tests see errors)."""
        import openai

        return openai.AsyncOpenAI(
            base_url=f"http://{self.server.http_address}/v1", api_key=key, max_retries=0
        )


async def start_gateway(
    handles: dict[str, Any], tenancy_settings: TenancySettings, tiny_dir: Path, **settings: Any
) -> tuple[GatewayServer, Tenancy]:
    routes = [
        serve_route(handles["tiny"], "shared", tiny_dir),
        serve_route(handles["smol"], "shared", None),
        serve_route(handles["vip"], "vip", tiny_dir),
    ]
    gw_settings = GatewaySettings(port=0, http_port=0, metrics_port=0, drain_grace_s=5.0, **settings)
    running = await serving.bootstrap.start_gateway(gw_settings, tenancy_settings, routes)
    return running.server, running.tenancy


@contextlib.asynccontextmanager
async def private_gateway(
    handle: Any, tenancy_settings: TenancySettings, tiny_dir: Path, **settings: Any
) -> AsyncIterator[GatewayServer]:
    """A gateway of its own in front of one engine deployment (for tests that break or load it)."""
    gw_settings = GatewaySettings(**{"port": 0, "http_port": 0, "metrics_port": None, **settings})
    async with running_gateway(
        gw_settings, tenancy_settings, [serve_route(handle, "shared", tiny_dir)]
    ) as gw:
        yield gw.server


@pytest.fixture(scope="session")
async def gateway(
    engine_handles: dict[str, Any], tenancy_settings: TenancySettings, tiny_dir: Path
) -> AsyncIterator[Gateway]:
    server, tenancy = await start_gateway(engine_handles, tenancy_settings, tiny_dir)
    store = RedisTenantStore.from_settings(tenancy_settings)
    yield Gateway(server, tenancy, store, engine_handles)
    await server.stop(grace_s=1.0)
    await tenancy.stop()


async def engine_idle(handle: Any) -> bool:
    s = await handle.stats.remote()
    return s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0
