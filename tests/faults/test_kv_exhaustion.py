"""A KV-cache exhaustion storm: two tenants (one interactive, one batch) ask for far more KV blocks
than a replica has, so sequences are preempted and recomputed again and again; every stream still
completes with exactly the greedy tokens of an uninterrupted run, and nothing is left held."""

from __future__ import annotations

import asyncio
from pathlib import Path

from common import Priority
from gateway.grpc.client import LoomClient
from loadtest.soak_streams import GreedyReference, Received, grpc_stream
from tests.faults.harness import (
    Engines,
    Tenants,
    delete_prefix,
    pool_idle,
    slots_come_back,
    tenancy_settings,
    wait_usage,
)
from tests.gateway.conftest import private_gateway

STREAMS_PER_TENANT = 4
MAX_TOKENS = 150
# 32 blocks of 8 tokens: one request (about 175 tokens, 22 blocks) fits, eight at once need 176 blocks.
NUM_BLOCKS = 32


async def test_kv_exhaustion_storm_preempts_and_recomputes_exactly(
    engines: Engines, model_dir: Path, reference: GreedyReference, redis_url: str
) -> None:
    settings = tenancy_settings(redis_url)
    try:
        with engines.deploy("faults-kv", num_blocks=NUM_BLOCKS, kv_cache_memory_mb=None) as handle:
            before = await handle.stats.remote()
            async with private_gateway(handle, settings, model_dir) as server:
                tenants = Tenants(settings, server.tenancy)
                quota = {"max_concurrent": STREAMS_PER_TENANT}
                chat = await tenants.create(
                    quotas=quota, priority_ceiling=Priority.INTERACTIVE, default_priority=Priority.INTERACTIVE
                )
                bulk = await tenants.create(
                    quotas=quota, priority_ceiling=Priority.BATCH, default_priority=Priority.BATCH
                )
                streams = [
                    Received(t.id, f"{name} request number {i}", MAX_TOKENS)
                    for name, (t, _) in (("bulk", bulk), ("chat", chat))
                    for i in range(STREAMS_PER_TENANT)
                ]
                reference.compute((r.prompt, r.max_tokens) for r in streams)
                clients = {t.id: LoomClient(server.address, key) for t, key in (chat, bulk)}
                try:
                    await asyncio.gather(*(grpc_stream(clients[r.tenant_id], r) for r in streams))
                    assert [r.code for r in streams] == ["OK"] * len(streams), [
                        (r.code, r.message) for r in streams
                    ]
                    assert reference.check(streams) == []
                    after = await handle.stats.remote()
                    assert after.kv_blocks_total == NUM_BLOCKS
                    assert after.num_preemptions > before.num_preemptions  # the storm did preempt

                    await pool_idle(handle, replicas=1)
                    for tenant, _ in (chat, bulk):
                        mine = [r for r in streams if r.tenant_id == tenant.id]
                        assert await wait_usage(tenants, tenant.id, len(mine)) == (
                            len(mine),
                            sum(r.tokens for r in mine),
                        )
                        assert tenants.leases(tenant.id) == (0, 0)
                        await slots_come_back(
                            clients[tenant.id], tenant.id, STREAMS_PER_TENANT, prompt="again"
                        )
                finally:
                    for client in clients.values():
                        await client.close()
    finally:
        delete_prefix(settings)
