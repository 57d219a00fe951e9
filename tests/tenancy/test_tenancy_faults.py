"""Faults: a dead lease holder, Redis killed and restarted, Redis frozen (SIGSTOP), a black-hole port.

Fault tests use their own redis-server processes (never the shared one). Each potentially blocking
call is wrapped in a generous hang guard (``asyncio.timeout``): the property under test is "never
hangs, answers in the configured mode", not a latency figure.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import socket

import pytest
import redis
from prometheus_client import REGISTRY
from tenancy_testlib import TEST_SECRET, eventually, hold_leases_process, make_tenant, rid

from tenancy.admission import Limit, QuotaMode
from tenancy.admission_redis import RedisAdmission
from tenancy.directory import TenantDirectory
from tenancy.errors import StoreUnavailableError
from tenancy.keys import KeyHasher
from tenancy.models import Tenant
from tenancy.redis_layout import RedisLayout
from tenancy.settings import TenancySettings
from tenancy.store_redis import RedisTenantStore
from tenancy.watch_redis import RedisTenantWatcher

HANG_GUARD_S = 15


def fault_settings(url: str, **overrides) -> TenancySettings:
    values = {
        "store": "redis",
        "redis_url": url,
        "key_prefix": "loomfault",
        "secret": TEST_SECRET,
        "redis_timeout_s": 0.25,
        "redis_probe_interval_s": 0.2,
        "gateway_replicas": 2,
    }
    values.update(overrides)
    return TenancySettings(**values)


def mode_gauge(mode: str) -> float | None:
    return REGISTRY.get_sample_value("loom:tenancy_quota_mode", {"mode": mode})


async def test_killed_holders_leases_expire_and_slots_come_back(settings_factory, redis_client):
    settings = settings_factory(lease_ttl_s=1.0)
    tenant = make_tenant(max_concurrent=2)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    values = {k: getattr(settings, k) for k in ("store", "redis_url", "key_prefix", "lease_ttl_s")}
    values["secret"] = TEST_SECRET
    child = ctx.Process(target=hold_leases_process, args=(values, tenant.model_dump_json(), 2, ready))
    child.start()
    try:
        held = await asyncio.to_thread(ready.get, True, 60)
        assert len(held) == 2
        child.kill()  # the gateway dies without finishing its streams
        child.join(10)
        enforcer = RedisAdmission.from_settings(settings)
        try:
            refused = await enforcer.admit(tenant, rid(), 1, 1)
            assert refused.limit is Limit.CONCURRENCY and 0 < refused.retry_after_s <= 1.0

            async def slot_back() -> bool:
                return (await enforcer.admit(tenant, rid(), 1, 1)).granted

            await eventually(slot_back, timeout_s=15, interval_s=0.1)
            assert (await enforcer.admit(tenant, rid(), 1, 1)).granted  # both slots came back
            assert not (await enforcer.admit(tenant, rid(), 1, 1)).granted
        finally:
            await enforcer.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


async def test_redis_killed_then_restarted(redis_server_factory, caplog):
    server = redis_server_factory(persistent=True)
    settings = fault_settings(server.url)
    hasher = KeyHasher(TEST_SECRET.encode())
    store = RedisTenantStore(
        redis.Redis.from_url(server.url, socket_timeout=2), hasher, layout=RedisLayout("loomfault")
    )
    quotas = {"requests_per_minute": 10, "max_concurrent": None}
    tenant = store.create_tenant(Tenant(id="acme", quotas=quotas), actor="test")
    directory = TenantDirectory(hasher)
    watcher = RedisTenantWatcher.from_settings(settings, directory)
    await watcher.start(require_initial=True)
    await watcher.wait_subscribed()
    enforcer = RedisAdmission.from_settings(settings)
    caplog.set_level(logging.INFO, logger="tenancy")
    try:
        before = await enforcer.admit(tenant, "before", 100, 50)
        assert before.granted and before.backend is QuotaMode.REDIS and enforcer.mode is QuotaMode.REDIS

        server.kill()
        async with asyncio.timeout(HANG_GUARD_S):
            during = [await enforcer.admit(tenant, f"during-{i}", 10, 10) for i in range(6)]
        # fail-static: this replica (of 2) enforces half of what Redis last left: 9 of 10 requests/min
        # (one was spent before the outage), so 4.5 here; a bucket starting full would grant 5.
        assert [a.granted for a in during] == [True] * 4 + [False] * 2
        assert {a.backend for a in during} == {QuotaMode.FAIL_STATIC}
        assert during[-1].limit is Limit.REQUESTS_PER_MINUTE
        assert enforcer.mode is QuotaMode.FAIL_STATIC and mode_gauge("fail_static") == 1.0
        assert "admission mode is now fail_static" in caplog.text
        assert directory.get("acme") is not None  # the cached config keeps serving

        async with asyncio.timeout(HANG_GUARD_S):
            local_done = await enforcer.finish(tenant, "during-0", 7, prompt_tokens=10)
            redis_done = await enforcer.finish(tenant, "before", 20)
        assert local_done.recorded and local_done.backend is QuotaMode.FAIL_STATIC
        assert redis_done.deferred and enforcer.pending_finishes == 2

        server.start()  # same port; the append-only file brings the data back

        async def back_on_redis() -> bool:
            return (await enforcer.admit(tenant, rid(), 1, 1)).backend is QuotaMode.REDIS

        await eventually(back_on_redis, timeout_s=HANG_GUARD_S)
        assert enforcer.mode is QuotaMode.REDIS and mode_gauge("redis") == 1.0
        assert "back to redis" in caplog.text
        await eventually(lambda: enforcer.pending_finishes == 0)
        usage = store.usage("acme", 1)[-1]
        # both the Redis-admitted and the locally admitted request were metered exactly once
        assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (2, 110, 27)

        # the change subscription came back too: an admin change after the restart reaches the cache
        store.update_tenant("acme", {"weight": 4}, actor="test")
        await eventually(lambda: directory.get("acme").weight == 4, timeout_s=HANG_GUARD_S)
    finally:
        await enforcer.close()
        await watcher.stop()
        store.close()


@pytest.mark.parametrize("failure_mode", ["fail_static", "fail_closed"])
async def test_redis_that_stops_answering(redis_server_factory, failure_mode):
    server = redis_server_factory()
    settings = fault_settings(server.url, failure_mode=failure_mode)
    tenant = make_tenant("acme", requests_per_minute=100)
    enforcer = RedisAdmission.from_settings(settings)
    try:
        assert (await enforcer.admit(tenant, rid(), 1, 1)).backend is QuotaMode.REDIS
        server.pause()  # SIGSTOP: connections stay open, nothing answers
        try:
            async with asyncio.timeout(HANG_GUARD_S):
                # A timeout may be the gateway's own load: the first ones refuse their own request
                # (retryable) and leave the mode alone; only several in a row degrade it.
                await _timeouts_before_degrading(enforcer, tenant, settings.redis_timeouts_to_degrade)
                frozen = await enforcer.admit(tenant, rid(), 1, 1)
                again = await enforcer.admit(tenant, rid(), 1, 1)  # within the probe interval
            if failure_mode == "fail_static":
                assert frozen.granted and frozen.backend is QuotaMode.FAIL_STATIC
                assert enforcer.mode is QuotaMode.FAIL_STATIC
            else:
                assert not frozen.granted and frozen.limit is Limit.QUOTA_STORE_UNAVAILABLE
                assert frozen.retry_after_s > 0 and frozen.backend is QuotaMode.FAIL_CLOSED
                assert enforcer.mode is QuotaMode.FAIL_CLOSED and mode_gauge("fail_closed") == 1.0
            assert again.backend is frozen.backend
        finally:
            server.resume()

        async def recovered() -> bool:
            return (await enforcer.admit(tenant, rid(), 1, 1)).backend is QuotaMode.REDIS

        await eventually(recovered, timeout_s=HANG_GUARD_S)
    finally:
        await enforcer.close()


async def _timeouts_before_degrading(enforcer: RedisAdmission, tenant: Tenant, in_a_row: int) -> None:
    for _ in range(in_a_row - 1):
        refused = await enforcer.admit(tenant, rid(), 1, 1)
        assert not refused.granted and refused.limit is Limit.QUOTA_STORE_UNAVAILABLE
        assert refused.retry_after_s is not None and refused.retry_after_s > 0
        assert enforcer.mode is QuotaMode.REDIS


async def test_black_hole_never_hangs(hasher):
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(128)  # the kernel completes handshakes; nobody ever reads or answers
    url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
    settings = fault_settings(url)
    tenant = make_tenant("acme", max_concurrent=3)
    enforcer = RedisAdmission.from_settings(settings)
    directory = TenantDirectory(hasher)
    watcher = RedisTenantWatcher.from_settings(settings, directory)
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            await _timeouts_before_degrading(enforcer, tenant, settings.redis_timeouts_to_degrade)
            admission = await enforcer.admit(tenant, rid(), 1, 1)
            await watcher.start()  # starts anyway, serving the (empty) cache, retrying behind
            with pytest.raises(StoreUnavailableError):
                await watcher.resync()
            finished = await enforcer.finish(tenant, admission.request_id, 1)
        assert admission.granted and admission.backend is QuotaMode.FAIL_STATIC
        assert finished.recorded
        with pytest.raises(StoreUnavailableError):
            await asyncio.to_thread(RedisTenantStore.from_settings(settings, hasher).list_tenants)
    finally:
        await watcher.stop()
        await enforcer.close()
        hole.close()


async def test_gateway_started_while_redis_is_down_loads_config_when_it_returns(redis_server_factory, hasher):
    server = redis_server_factory(persistent=True)
    store = RedisTenantStore(
        redis.Redis.from_url(server.url, socket_timeout=2), hasher, layout=RedisLayout("loomfault")
    )
    store.create_tenant(Tenant(id="acme"), actor="test")
    key = store.create_key("acme", actor="test").plaintext.get_secret_value()
    store.close()
    server.stop()
    directory = TenantDirectory(hasher)
    watcher = RedisTenantWatcher.from_settings(fault_settings(server.url), directory)
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            await watcher.start()  # does not hang, does not fail: serves what it has (nothing yet)
        assert len(directory) == 0
        server.start()
        await eventually(lambda: directory.get("acme") is not None, timeout_s=HANG_GUARD_S)
        assert directory.authenticate(key).tenant_id == "acme"
    finally:
        await watcher.stop()


async def test_timeouts_that_are_not_in_a_row_never_degrade_admission(redis_server_factory):
    """A loaded gateway's late event loop times out a call now and then: each such call is refused as
    retryable, the next answer starts the count over, and limits stay Redis's throughout."""
    server = redis_server_factory()
    settings = fault_settings(server.url)
    tenant = make_tenant("acme", requests_per_minute=100)
    enforcer = RedisAdmission.from_settings(settings)
    answer = enforcer._eval
    late = iter(())

    async def sometimes_late(keys, args):
        if next(late, False):
            raise TimeoutError
        return await answer(keys, args)

    enforcer._eval = sometimes_late  # type: ignore[method-assign]
    try:
        for _ in range(3):
            late = iter([True] * (settings.redis_timeouts_to_degrade - 1) + [False])
            results = [
                await enforcer.admit(tenant, rid(), 1, 1) for _ in range(settings.redis_timeouts_to_degrade)
            ]
            assert [r.granted for r in results] == [False] * (settings.redis_timeouts_to_degrade - 1) + [True]
            assert results[-1].backend is QuotaMode.REDIS and enforcer.mode is QuotaMode.REDIS
    finally:
        await enforcer.close()
