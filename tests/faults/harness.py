"""What the fault tests (and the fuzz tests) share: Ray for one test folder, engine deployments of the
tiny random model, tenants a gateway knows, streams that record exactly what their client received,
and the checks every fault test ends with (the streams and their greedy reference are
loadtest/soak_streams.py, which ``loom soak`` uses too).

The checks are the invariants a fault must not break:

* every stream that completes carries exactly the greedy tokens of an uninterrupted run
  (``loadtest.soak_streams.GreedyReference``, the engine in this process on the same weights);
* no KV block, running or waiting sequence is left in any replica once the traffic is over
  (:func:`pool_idle`);
* no lease is left in the quota store, and the tenant's concurrency slots all come back
  (:meth:`Tenants.leases`, :func:`slots_come_back`);
* the usage metered for a tenant equals the tokens its clients received (:meth:`Tenants.usage`, and
  :meth:`Tenants.billed` per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from gateway.grpc.client import LoomClient
from loadtest.soak_streams import Received, grpc_stream
from protocol.engine_config import EngineConfig
from serving.app import PoolSpec, engine_app
from serving.replica_stats import process_registry
from tenancy import RedisTenantStore, Tenancy, TenancySettings
from tenancy.models import Quotas, Tenant
from tenancy.redis_layout import RedisLayout
from tests.helpers import eventually

TINY = "tiny"
SECRET = "faults-test-secret-0123456789abcdef"
# Replicas publish their stats to the router every second (serving.replica), and Serve forwards a
# publication only when it changed: a state that lasted this long has been published.
STATS_SETTLE_S = 2.5


# ---- Ray and the engine deployments ---------------------------------------------------------------


class Engines:
    """Engine deployments of one model on the folder's Ray (see :func:`ray_for_folder`)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    @contextlib.contextmanager
    def deploy(self, app_name: str, replicas: int = 1, **engine: Any) -> Iterator[Any]:
        """An engine deployment of its own (a Serve application), deleted afterwards."""
        from ray import serve

        spec = PoolSpec(name="shared", replicas=replicas, engine=tiny_engine(self.model_dir, **engine))
        handle = serve.run(engine_app(spec), name=app_name, route_prefix=None)
        try:
            yield handle
        finally:
            serve.delete(app_name)


@contextlib.contextmanager
def ray_for_folder(model_dir: Path) -> Iterator[Engines]:
    """Ray and Serve for the tests of one folder, shut down when the folder is done.

    pytest cannot share a session fixture between sibling folders without running it once per folder,
    and tests/gateway starts its own Ray: so a folder that finds Ray already running (its tests were
    selected after the gateway's) uses it and leaves it up; otherwise it starts Ray and stops it at the
    end, before the next folder starts its own.
    """
    import ray
    from ray import serve

    from serving.bootstrap import start_ray, start_serve

    started = not ray.is_initialized()
    if started:
        start_ray(num_cpus=8)  # logical CPUs: replicas reserve them; the real cores are shared anyway
    start_serve()
    try:
        yield Engines(model_dir)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


def tiny_engine(model_dir: Path, **overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model_path=str(model_dir), block_size=8, kv_cache_memory_mb=8, max_num_seqs=8, num_threads=1
    )
    return EngineConfig(**{**base, **overrides})


def replica_stats(handle: Any) -> dict[str, Any]:
    """The latest stats each replica of a deployment published (to this process's router)."""
    return process_registry().replicas(f"{handle.app_name}/{handle.deployment_name}")


async def pool_idle(handle: Any, replicas: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until every one of ``replicas`` replicas reports no KV block in use and nothing running or
    waiting; returns their stats. Called when the traffic is over: the wait first lets every replica
    publish what it holds now, so a snapshot from before the traffic cannot pass for idle."""
    await asyncio.sleep(STATS_SETTLE_S)

    def idle() -> bool:
        stats = replica_stats(handle)
        return len(stats) == replicas and all(
            s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 for s in stats.values()
        )

    try:
        await eventually(idle, timeout_s=timeout_s, interval_s=0.2)
    except AssertionError:
        raise AssertionError(f"replicas not idle: {_describe(replica_stats(handle))}") from None
    return replica_stats(handle)


def _describe(stats: dict[str, Any]) -> str:
    return ", ".join(
        f"{rid[:8]}: kv={s.kv_blocks_used} running={s.num_running} waiting={s.num_waiting}"
        for rid, s in stats.items()
    )


# ---- tenants and usage ----------------------------------------------------------------------------


def tenancy_settings(redis_url: str, **overrides: Any) -> TenancySettings:
    """A Redis tenant store under a key prefix of its own (the caller deletes it)."""
    base: dict[str, Any] = dict(
        store="redis",
        redis_url=redis_url,
        key_prefix=f"loomfault-{uuid.uuid4().hex[:8]}",
        secret=SECRET,
        resync_interval_s=1.0,
        redis_timeout_s=2.0,  # a loaded 2-core machine must not flip admission into its local fallback
    )
    return TenancySettings(**{**base, **overrides})


def delete_prefix(settings: TenancySettings) -> None:
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    try:
        for key in client.scan_iter(match=f"{settings.key_prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


class Tenants:
    """Creates tenants in a Redis store and waits until a gateway's tenancy knows their keys."""

    def __init__(self, settings: TenancySettings, tenancy: Tenancy) -> None:
        self.settings = settings
        self.store = RedisTenantStore.from_settings(settings)
        self.tenancy = tenancy
        self.layout = RedisLayout(settings.key_prefix)

    async def create(self, **fields: Any) -> tuple[Tenant, str]:
        quotas = Quotas.unlimited().model_copy(update=fields.pop("quotas", {}))
        tenant = Tenant(id=f"t-{uuid.uuid4().hex[:10]}", quotas=quotas, **fields)
        self.store.create_tenant(tenant, actor="fault-tests")
        key = self.store.create_key(tenant.id, actor="fault-tests").plaintext.get_secret_value()
        await eventually(lambda: self._knows(key), timeout_s=20)
        return tenant, key

    def _knows(self, key: str) -> bool:
        try:
            self.tenancy.authenticate(key)
            return True
        except Exception:
            return False

    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)

    def usage(self, tenant_id: str) -> tuple[int, int]:
        """(requests, completion tokens) metered for the tenant (the last two UTC days, summed)."""
        days = self.store.usage(tenant_id, days=2)
        return sum(d.requests for d in days), sum(d.completion_tokens for d in days)

    def leases(self, tenant_id: str) -> tuple[int, int]:
        """(unexpired leases, lease entries of any age) in the quota store."""
        client = self._redis()
        try:
            entries = int(client.zcard(self.layout.leases(tenant_id)))
        finally:
            client.close()
        return self.store.quota_status(tenant_id)["active_leases"], entries

    def billed(self, tenant_id: str, request_id: str) -> tuple[str | None, int | None]:
        """(state, completion tokens) of one request's record: what it was charged."""
        client = self._redis()
        try:
            state, completion = client.hmget(
                self.layout.request(tenant_id, request_id), "state", "completion"
            )
        finally:
            client.close()
        return (
            state.decode() if state is not None else None,
            int(completion) if completion is not None else None,
        )


# ---- the invariants ------------------------------------------------------------------------------


async def slots_come_back(client: LoomClient, tenant_id: str, n: int, prompt: str = "slots") -> None:
    """All ``n`` concurrency slots of a tenant are free: ``n`` streams run at once, none refused."""
    streams = [Received(tenant_id, f"{prompt} {i}", 200) for i in range(n)]
    started = [asyncio.Event() for _ in streams]
    tasks = [
        asyncio.create_task(grpc_stream(client, r, first_chunk=e))
        for r, e in zip(streams, started, strict=True)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # all admitted at once
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
    assert [r.code for r in streams] == ["OK"] * n, [(r.code, r.message) for r in streams]


async def wait_usage(
    tenants: Tenants, tenant_id: str, requests: int, timeout_s: float = 30.0
) -> tuple[int, int]:
    """The tenant's metered (requests, completion tokens), once ``requests`` requests are recorded."""
    await eventually(lambda: tenants.usage(tenant_id)[0] >= requests, timeout_s=timeout_s, interval_s=0.1)
    return tenants.usage(tenant_id)
