"""Gateway fixtures: one real Ray + Serve per session, real engine replicas (a tiny random model and
the embedded SmolLM2), the real gateway over a loopback socket, tenants in the real Redis."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.catalog import ModelCatalog
from gateway.client import LoomClient
from gateway.pools import ServeEnginePool
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from loom.app import PoolSpec, engine_app
from tenancy import RedisTenantStore, Tenancy, TenancySettings
from tenancy.models import Quotas, Tenant
from tests.helpers import eventually
from worker.api import EngineConfig, load_tokenizer, process_registry

SECRET = "gateway-test-secret-0123456789abcdef"
TINY = "tiny"
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[None]:
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    # Logical CPUs: replicas reserve them for scheduling; the 2 real cores are shared anyway.
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    serve.start(proxy_location=ProxyLocation.Disabled)
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
    tenancy = Tenancy.from_settings(tenancy_settings)
    await tenancy.start()
    tiny_tok, smol_tok = load_tokenizer(tiny_dir), load_tokenizer(None)
    catalog = await ModelCatalog.build(
        [
            (ServeEnginePool(handles["tiny"], "shared", process_registry()), tiny_tok),
            (ServeEnginePool(handles["smol"], "shared", process_registry()), smol_tok),
            (ServeEnginePool(handles["vip"], "vip", process_registry()), tiny_tok),
        ]
    )
    gw_settings = GatewaySettings(port=0, http_port=0, metrics_port=0, drain_grace_s=5.0, **settings)
    server = await GatewayServer(gw_settings, tenancy, catalog).start()
    return server, tenancy


@contextlib.asynccontextmanager
async def private_gateway(
    handle: Any, tenancy_settings: TenancySettings, tiny_dir: Path, **settings: Any
) -> AsyncIterator[GatewayServer]:
    """A gateway of its own in front of one engine deployment (for tests that break or load it)."""
    tenancy = Tenancy.from_settings(tenancy_settings)
    await tenancy.start()
    catalog = await ModelCatalog.build(
        [(ServeEnginePool(handle, "shared", process_registry()), load_tokenizer(tiny_dir))]
    )
    server = await GatewayServer(
        GatewaySettings(**{"port": 0, "http_port": 0, "metrics_port": None, **settings}), tenancy, catalog
    ).start()
    try:
        yield server
    finally:
        await server.stop(grace_s=0)
        await tenancy.stop()


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
