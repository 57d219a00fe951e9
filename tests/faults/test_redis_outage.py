"""Redis stopped for ten seconds under two tenants' streams, then restarted (docs/tenancy.md, "When
Redis does not answer"): in fail-static mode streams in flight complete, new requests are admitted by
the gateway's local limiter, and once Redis answers again the buffered usage is replayed, so the usage
in Redis equals the tokens the clients received and no lease is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.grpc.client import LoomClient
from loadtest.soak_streams import GreedyReference, Received, grpc_stream
from tenancy import QuotaMode
from tests.faults.harness import Tenants, pool_idle, slots_come_back, tenancy_settings, wait_usage
from tests.gateway.conftest import private_gateway
from tests.helpers import eventually

if TYPE_CHECKING:
    from tests.conftest import RedisProcess

OUTAGE_S = 10.0
MAX_CONCURRENT = 8


async def test_redis_stopped_for_ten_seconds_then_restarted(
    pair: Any,
    model_dir: Path,
    reference: GreedyReference,
    redis_server_factory: Callable[..., RedisProcess],
) -> None:
    quota_store = redis_server_factory(persistent=True)  # the restart keeps tenants and counters (AOF)
    settings = tenancy_settings(quota_store.url)
    assert settings.failure_mode.value == "fail_static"  # the default this test is about
    loop = asyncio.get_running_loop()
    async with private_gateway(pair, settings, model_dir) as server:
        admission: Any = server.tenancy.admission
        tenants = Tenants(settings, server.tenancy)
        pair_of_tenants = [await tenants.create(quotas={"max_concurrent": MAX_CONCURRENT}) for _ in range(2)]
        clients = {t.id: LoomClient(server.address, key) for t, key in pair_of_tenants}
        streams: list[Received] = []
        tasks: list[asyncio.Task[Received]] = []

        def launch(label: str, max_tokens: int) -> list[Received]:
            batch = [
                Received(t.id, f"{label} of tenant {n}", max_tokens)
                for n, (t, _) in enumerate(pair_of_tenants)
            ]
            for r in batch:
                streams.append(r)
                tasks.append(asyncio.create_task(grpc_stream(clients[r.tenant_id], r)))
            return batch

        try:
            # Admitted by Redis, streaming when it stops.
            in_flight = launch("before the outage", 900) + launch("also before", 900)
            await eventually(lambda: all(r.tokens for r in in_flight), timeout_s=30, interval_s=0.005)
            quota_store.stop()
            stopped_at = loop.time()
            modes = set()
            # New requests while Redis is down: the local limiter admits them.
            for k in range(6):
                during = launch(f"during the outage {k}", 60)
                await eventually(lambda b=during: all(r.tokens or r.code != "OK" for r in b), timeout_s=30)
                modes.add(server.tenancy.quota_mode)
                await asyncio.sleep(1.0)
            # Still during the outage (the machine may be slow: the outage lasts as long as it takes).
            await eventually(lambda: all(r.finished for r in in_flight), timeout_s=120)
            assert admission.pending_finishes > 0  # their usage waits for Redis
            # Admitted locally, still streaming when Redis comes back.
            spanning = launch("across the restart", 900)
            await eventually(lambda: all(r.tokens for r in spanning), timeout_s=30, interval_s=0.005)
            await asyncio.sleep(max(0.0, OUTAGE_S - (loop.time() - stopped_at)))
            quota_store.start()
            await asyncio.gather(*tasks)

            assert modes == {QuotaMode.FAIL_STATIC}
            assert [r.code for r in streams] == ["OK"] * len(streams), [(r.code, r.message) for r in streams]
            assert reference.check(streams) == []
            await eventually(
                lambda: server.tenancy.quota_mode is QuotaMode.REDIS and admission.pending_finishes == 0,
                timeout_s=30,
            )
            for tenant, _ in pair_of_tenants:
                mine = [r for r in streams if r.tenant_id == tenant.id]
                assert await wait_usage(tenants, tenant.id, len(mine)) == (
                    len(mine),
                    sum(r.tokens for r in mine),
                )
                assert tenants.leases(tenant.id) == (0, 0)
            await pool_idle(pair, replicas=2)
            for tenant, _ in pair_of_tenants:  # slots come back, now through Redis again
                await slots_come_back(clients[tenant.id], tenant.id, MAX_CONCURRENT)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for client in clients.values():
                await client.close()
