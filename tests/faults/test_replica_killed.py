"""A replica SIGKILLed while two tenants stream through it: the pool of two replicas carries on."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.grpc.client import LoomClient
from loadtest.soak_streams import GreedyReference, Received, grpc_stream
from tests.faults.harness import (
    Engines,
    Tenants,
    delete_prefix,
    pool_idle,
    replica_stats,
    slots_come_back,
    tenancy_settings,
    wait_usage,
)
from tests.gateway.conftest import private_gateway
from tests.helpers import eventually

STREAMS_PER_TENANT = 4
MAX_TOKENS = 900


async def test_replica_killed_mid_stream_loses_nothing(
    engines: Engines,
    model_dir: Path,
    reference: GreedyReference,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.resume")
    settings = tenancy_settings(redis_url)
    try:
        with engines.deploy("faults-kill", replicas=2) as handle:
            async with private_gateway(handle, settings, model_dir) as server:
                tenants = Tenants(settings, server.tenancy)
                quota = {"max_concurrent": STREAMS_PER_TENANT}
                pair = [await tenants.create(quotas=quota) for _ in range(2)]
                streams = [
                    Received(t.id, f"tenant {n} keeps streaming {i}", MAX_TOKENS)
                    for n, (t, _) in enumerate(pair)
                    for i in range(STREAMS_PER_TENANT)
                ]
                reference.compute((r.prompt, r.max_tokens) for r in streams)
                clients = {t.id: LoomClient(server.address, key) for t, key in pair}
                try:
                    tasks = [asyncio.create_task(grpc_stream(clients[r.tenant_id], r)) for r in streams]
                    # Every stream is under way, and the replicas have published that they run them all,
                    # when the one running the most dies.
                    await eventually(
                        lambda: min(r.tokens for r in streams) >= 10, timeout_s=60, interval_s=0.005
                    )
                    await eventually(_running(handle, len(streams)), timeout_s=30, interval_s=0.05)
                    victim = max(replica_stats(handle).values(), key=lambda s: s.num_running).pid
                    os.kill(victim, signal.SIGKILL)
                    await asyncio.gather(*tasks)

                    assert [(r.code, r.finish_reason) for r in streams] == [
                        ("OK", "FINISH_REASON_LENGTH")
                    ] * len(streams), [(r.code, r.message) for r in streams]
                    assert reference.check(streams) == []
                    assert any("resuming" in rec.getMessage() for rec in caplog.records), (
                        "no stream was resumed"
                    )

                    stats = await pool_idle(handle, replicas=2)  # the replacement is up and nothing leaked
                    assert victim not in {s.pid for s in stats.values()}
                    for tenant, _ in pair:
                        delivered = sum(r.tokens for r in streams if r.tenant_id == tenant.id)
                        assert await wait_usage(tenants, tenant.id, STREAMS_PER_TENANT) == (
                            STREAMS_PER_TENANT,
                            delivered,
                        )
                        assert tenants.leases(tenant.id) == (0, 0)
                        await slots_come_back(clients[tenant.id], tenant.id, STREAMS_PER_TENANT)
                finally:
                    for client in clients.values():
                        await client.close()
    finally:
        delete_prefix(settings)


def _running(handle: object, n: int) -> Callable[[], bool]:
    """Whether the replicas' latest published stats show ``n`` requests running in all."""

    def all_running() -> bool:
        return sum(s.num_running for s in replica_stats(handle).values()) >= n

    return all_running
