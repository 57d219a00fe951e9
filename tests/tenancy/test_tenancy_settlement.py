"""Settlement of lapsed leases: a holder that vanishes without ``finish`` is charged what its last
renewal reported, exactly once, on both implementations (Redis Lua script and in-process limiter).

Behavioural tests run against both (``make_enforcer``) with short real leases, awaited by polling;
exact time-dependent rules run on the in-process limiter with a fake clock.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from datetime import UTC, datetime

import pytest
from tenancy_testlib import (
    TEST_SECRET,
    eventually,
    hold_and_hang_process,
    make_tenant,
    quota_status,
    reported_completion,
    rid,
    usage_today,
)

from tenancy.admission import ActiveLease, Limit, Outcome
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.runtime import Tenancy, bootstrap_embedded

LEASE_S = 1.0  # long enough that a loaded machine renews in time, short enough to wait out


async def vanish_after_reporting(enforcer, tenant, admission, delivered: int, settings) -> ActiveLease:
    """Run ``hold()``'s background renewal until a renewal has reported ``delivered`` tokens, then stop
    it as a killed gateway would: no more renewals, no finish."""
    lease = enforcer.hold(tenant, admission)
    lease.completion_tokens = delivered
    lease.start_renewing()  # what ``async with hold(...)`` does on entry

    def reported() -> bool:
        return reported_completion(enforcer, settings, tenant.id, admission.request_id) == delivered

    await eventually(reported)
    lease._task.cancel()  # the process is gone
    with pytest.raises(asyncio.CancelledError):
        await lease._task
    return lease


async def settled_by_sweep(enforcer, tenant, settings) -> None:
    """Poll the sweep until it has settled the tenant's lapsed lease."""

    async def swept() -> bool:
        await enforcer.sweep([tenant])
        return usage_today(enforcer, settings, tenant.id).requests >= 1

    await eventually(swept, interval_s=0.05)


# -- (a) a vanished holder is charged prompt + its last reported completion tokens -------------------
async def test_vanished_holder_is_settled_from_its_last_renewal(make_enforcer, settings):
    enforcer = make_enforcer(lease_ttl_s=LEASE_S)
    tenant = make_tenant(max_concurrent=1, daily_token_budget=10_000, monthly_token_budget=100_000)
    admission = await enforcer.admit(tenant, rid(), 40, 500)
    assert admission.granted
    assert quota_status(enforcer, settings, tenant.id)["day_tokens_used"] == 540  # the reservation

    await vanish_after_reporting(enforcer, tenant, admission, 17, settings)
    await settled_by_sweep(enforcer, tenant, settings)

    status = quota_status(enforcer, settings, tenant.id)
    assert status == {"active_leases": 0, "day_tokens_used": 57, "month_tokens_used": 57}
    usage = usage_today(enforcer, settings, tenant.id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (1, 40, 17)
    assert (usage.expired, usage.cancelled, usage.errors) == (1, 0, 0)
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted  # the concurrency slot is free


async def test_lapsed_lease_is_settled_by_the_admission_that_notices_it(make_enforcer, settings):
    """No sweep: the tenant's next admission settles the lapsed lease first, and its refund counts."""
    enforcer = make_enforcer(lease_ttl_s=LEASE_S)
    tenant = make_tenant(daily_token_budget=1000)
    held = await enforcer.admit(tenant, rid(), 100, 800)  # reserves 900 of 1000
    assert (await enforcer.renew(tenant, held.request_id, completion_tokens=50)).renewed
    refused = await enforcer.admit(tenant, "needs-800", 100, 700)
    assert refused.limit is Limit.DAILY_BUDGET  # 900 + 800 > 1000 while the lease is live

    async def admitted() -> bool:
        return (await enforcer.admit(tenant, rid(), 100, 700)).granted  # 150 + 800 <= 1000

    await eventually(admitted, interval_s=0.05)
    assert quota_status(enforcer, settings, tenant.id)["day_tokens_used"] == 150 + 800
    usage = usage_today(enforcer, settings, tenant.id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.expired) == (1, 100, 50, 1)


# -- (b) a finish (or renewal) after settlement changes nothing --------------------------------------
async def test_finish_after_settlement_changes_nothing(make_enforcer, settings):
    enforcer = make_enforcer(lease_ttl_s=LEASE_S)
    tenant = make_tenant(tokens_per_minute=100_000, daily_token_budget=10_000)
    admission = await enforcer.admit(tenant, rid(), 30, 300)
    await vanish_after_reporting(enforcer, tenant, admission, 12, settings)
    await settled_by_sweep(enforcer, tenant, settings)
    status = quota_status(enforcer, settings, tenant.id)
    usage = usage_today(enforcer, settings, tenant.id)
    assert status["day_tokens_used"] == 42

    late = await enforcer.finish(tenant, admission.request_id, 250, outcome=Outcome.OK)
    assert not late.recorded and late.refunded_tokens == 0
    renewal = await enforcer.renew(tenant, admission.request_id, completion_tokens=260)
    assert not renewal.renewed and renewal.reason == "lost"
    assert await enforcer.sweep([tenant]) == 0
    assert quota_status(enforcer, settings, tenant.id) == status
    assert usage_today(enforcer, settings, tenant.id) == usage


async def test_hold_of_a_settled_lease_finishes_as_a_no_op(make_enforcer, settings):
    """A gateway that stalls past its lease and comes back: its renewal says ``lost`` and its finish
    records nothing more (the stalled holder's lease was settled meanwhile)."""
    enforcer = make_enforcer(lease_ttl_s=LEASE_S)
    tenant = make_tenant(max_concurrent=1)
    admission = await enforcer.admit(tenant, rid(), 5, 50)
    assert (await enforcer.renew(tenant, admission.request_id, completion_tokens=3)).renewed

    async def slot_taken() -> bool:
        return (await enforcer.admit(tenant, rid(), 1, 1)).granted  # settles the lapsed lease

    await eventually(slot_taken, interval_s=0.05)
    async with enforcer.hold(tenant, admission) as lease:
        lease.completion_tokens = 40
        await eventually(lambda: lease.lost)
    assert not (await lease.finish()).recorded
    usage = usage_today(enforcer, settings, tenant.id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.expired) == (1, 5, 3, 1)


# -- (c) concurrent settlers settle once -------------------------------------------------------------
async def test_two_gateways_racing_settle_each_lease_once(enforcer_factory, settings):
    holder = enforcer_factory("redis", lease_ttl_s=LEASE_S)  # the gateway that dies
    # two live gateways (their own admissions hold long leases, so only the held ones lapse)
    first = enforcer_factory("redis", lease_ttl_s=60, lease_settle_batch=4)
    second = enforcer_factory("redis", lease_ttl_s=60, lease_settle_batch=4)
    tenant = make_tenant(daily_token_budget=1_000_000, monthly_token_budget=10_000_000)
    expected = 0
    for i in range(20):
        a = await holder.admit(tenant, f"held-{i}", 10 + i, 1000)
        assert (await holder.renew(tenant, a.request_id, completion_tokens=i)).renewed
        expected += 10 + i + i
    await eventually(lambda: quota_status(first, settings, tenant.id)["active_leases"] == 0)

    # Both gateways notice at once: sweeps and admissions (each settles a bounded batch).
    calls = [e.sweep([tenant]) for e in (first, second) for _ in range(6)]
    calls += [e.admit(tenant, f"new-{n}-{i}", 1, 1) for n, e in enumerate((first, second)) for i in range(6)]
    await asyncio.gather(*calls)
    while await first.sweep([tenant]):  # whatever the race left (batches are bounded)
        pass

    usage = usage_today(first, settings, tenant.id)
    assert (usage.requests, usage.expired) == (20, 20)
    assert usage.prompt_tokens + usage.completion_tokens == expected
    assert quota_status(first, settings, tenant.id)["day_tokens_used"] == expected + 12 * 2  # + new leases


def test_threads_racing_settle_each_lease_once():
    clock = FakeClock(datetime(2025, 6, 1, 12, tzinfo=UTC))
    lim = LocalAdmission(clock_us=clock, lease_ttl_s=10)
    tenant = make_tenant(daily_token_budget=1_000_000)
    expected = 0
    for i in range(200):
        lim.admit_sync(tenant, f"held-{i}", 10, 1000)
        lim.renew_sync(tenant, f"held-{i}", i % 7)
        expected += 10 + i % 7
    clock.advance(11)
    barrier = threading.Barrier(8)

    def settler(n: int) -> None:
        barrier.wait()
        for i in range(50):
            if n % 2:
                lim.sweep_sync(max_settle=3)
            else:
                lim.admit_sync(tenant, f"new-{n}-{i}", 1, 1)
                lim.renew_sync(tenant, f"held-{i}", 99)  # late renewals: lost, never a second charge

    threads = [threading.Thread(target=settler, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lim.sweep_sync()
    usage = lim.usage(tenant.id, 1)[-1]
    assert (usage.requests, usage.expired) == (200, 200)
    assert usage.prompt_tokens + usage.completion_tokens == expected
    assert lim.quota_status(tenant.id)["day_tokens_used"] == expected + 4 * 50 * 2


async def test_late_finish_racing_the_settlers_counts_once(make_enforcer, settings):
    """The holder's own late finish races the settlement: exactly one of them wins."""
    enforcer = make_enforcer(lease_ttl_s=LEASE_S)
    tenant = make_tenant(daily_token_budget=100_000)
    held = []
    for i in range(10):
        a = await enforcer.admit(tenant, f"held-{i}", 10, 100)
        assert (await enforcer.renew(tenant, a.request_id, completion_tokens=5)).renewed
        held.append(a.request_id)
    await eventually(lambda: quota_status(enforcer, settings, tenant.id)["active_leases"] == 0)
    results = await asyncio.gather(
        *(enforcer.finish(tenant, r, 60) for r in held), *(enforcer.sweep([tenant]) for _ in range(5))
    )
    finished = sum(1 for r in results[:10] if r.recorded)
    usage = usage_today(enforcer, settings, tenant.id)
    assert usage.requests == 10 and usage.expired == 10 - finished
    assert usage.completion_tokens == 60 * finished + 5 * (10 - finished)
    assert quota_status(enforcer, settings, tenant.id)["day_tokens_used"] == 100 + usage.completion_tokens


# -- (d) the sweep settles the lapsed leases of an idle tenant ---------------------------------------
async def test_redis_sweep_visits_a_bounded_number_of_tenants_per_call(enforcer_factory, settings):
    enforcer = enforcer_factory("redis", lease_ttl_s=LEASE_S, lease_sweep_tenants=1)
    tenants = [make_tenant(f"idle-{i}", daily_token_budget=10_000) for i in range(3)]
    for t in tenants:
        a = await enforcer.admit(t, rid(), 7, 100)
        assert (await enforcer.renew(t, a.request_id, completion_tokens=2)).renewed

    def all_lapsed() -> bool:
        return not any(quota_status(enforcer, settings, t.id)["active_leases"] for t in tenants)

    await eventually(all_lapsed)
    assert [await enforcer.sweep(tenants) for _ in range(4)] == [1, 1, 1, 0]  # round robin, one each
    for t in tenants:
        assert quota_status(enforcer, settings, t.id)["day_tokens_used"] == 9


async def test_runtime_sweep_settles_an_idle_tenant_of_the_embedded_store(tmp_path, settings_factory):
    settings = settings_factory(
        store="file",
        tenants_file=tmp_path / "tenants.yaml",
        secret_file=tmp_path / "secret",
        lease_ttl_s=LEASE_S,
        lease_sweep_interval_s=0.05,
    )
    bootstrap_embedded(settings)
    tenancy = Tenancy.from_settings(settings)
    await tenancy.start()
    try:
        tenant = make_tenant(daily_token_budget=10_000)
        admission = await tenancy.admission.admit(tenant, rid(), 20, 400)
        await vanish_after_reporting(tenancy.admission, tenant, admission, 9, settings)
        # Nothing touches this tenant any more: only the runtime's sweep can settle it.
        await eventually(lambda: tenancy.admission.quota_status(tenant.id)["day_tokens_used"] == 29)
        assert tenancy.admission.usage(tenant.id, 1)[-1].expired == 1
    finally:
        await tenancy.stop()


async def test_runtime_sweep_settles_the_lease_of_a_killed_gateway(settings_factory, store):
    """A real gateway process streams inside ``hold()`` and is killed; another process's runtime
    settles its lease with the tokens of its last renewal, with no traffic for that tenant."""
    settings = settings_factory(lease_ttl_s=0.5, lease_sweep_interval_s=0.05)
    tenant = store.create_tenant(make_tenant("killed-gw", daily_token_budget=10_000), actor="test")
    values = {k: getattr(settings, k) for k in ("store", "redis_url", "key_prefix", "lease_ttl_s")}
    values["secret"] = TEST_SECRET
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    child = ctx.Process(
        target=hold_and_hang_process, args=(values, tenant.model_dump_json(), 25, 500, 11, ready)
    )
    child.start()
    tenancy = Tenancy.from_settings(settings)
    try:
        request_id = await asyncio.to_thread(ready.get, True, 60)
        await eventually(lambda: reported_completion(None, settings, tenant.id, request_id) == 11)
        assert quota_status(None, settings, tenant.id)["day_tokens_used"] == 525
        child.kill()  # the gateway dies mid-stream: no finish
        child.join(10)
        await tenancy.start()
        await eventually(lambda: quota_status(None, settings, tenant.id)["day_tokens_used"] == 36)
        usage = usage_today(None, settings, tenant.id)
        assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.expired) == (1, 25, 11, 1)
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
        await tenancy.stop()


# -- exact rules on the in-process limiter -----------------------------------------------------------
class FakeClock:
    def __init__(self, when: datetime) -> None:
        self.us = int(when.timestamp() * 1_000_000)

    def __call__(self) -> int:
        return self.us

    def advance(self, seconds: float) -> None:
        self.us += int(seconds * 1_000_000)


def test_settlement_follows_the_finish_rules_exactly():
    """Tokens/min and the month get the unused reservation back, as from a finish; a settlement on
    the next day refunds the day it was charged to, never the new day."""
    clock = FakeClock(datetime(2025, 5, 5, 23, 59, 50, tzinfo=UTC))
    lim = LocalAdmission(clock_us=clock, lease_ttl_s=30)
    tenant = make_tenant(tokens_per_minute=6000, daily_token_budget=6000, monthly_token_budget=9000)
    a = lim.admit_sync(tenant, "a", 1000, 4000)  # 5000 of tokens/min, of May 5 and of May
    assert lim.renew_sync(tenant, "a", 500).renewed  # used 1500 so far: 3500 to give back
    assert lim.quota_status(tenant.id)["day_tokens_used"] == 5000
    clock.advance(35)  # May 6, 00:00:25: lapsed; tokens/min refilled 3500 -> 4500 left
    assert lim.sweep_sync() == 1
    status = lim.quota_status(tenant.id)
    assert status == {"active_leases": 0, "day_tokens_used": 0, "month_tokens_used": 1500}
    # 6000 fits tokens/min only with the 3500 refund, and May only with it too (1500 + 6000 <= 9000)
    assert lim.admit_sync(tenant, "b", 500, 5500).granted
    assert lim.quota_status(tenant.id)["month_tokens_used"] == 7500
    assert lim.finish_sync(tenant, a.request_id, 4000).recorded is False


def test_a_holder_back_before_anyone_noticed_keeps_its_lease():
    """First come wins: a lapsed lease that nobody has settled yet is reacquired by its holder's
    renewal if a slot is free; if none is, that renewal settles it with the count it reports."""
    clock = FakeClock(datetime(2025, 5, 5, 12, tzinfo=UTC))
    lim = LocalAdmission(clock_us=clock, lease_ttl_s=10)
    tenant = make_tenant(max_concurrent=1)
    lim.admit_sync(tenant, "a", 10, 100)
    clock.advance(11)
    renewal = lim.renew_sync(tenant, "a", 20)
    assert renewal.renewed and renewal.reason == "reacquired"
    assert lim.finish_sync(tenant, "a", 30).recorded  # finished normally, with its own count
    other = make_tenant(max_concurrent=1)
    lim.admit_sync(other, "x", 10, 100)
    clock.advance(11)
    lim._states[other.id].add_lease("intruder", clock.us + 10_000_000)  # the slot is taken meanwhile
    renewal = lim.renew_sync(other, "x", 20)
    assert not renewal.renewed and renewal.reason == "lost"
    usage = lim.usage(other.id, 1)[-1]
    assert (usage.requests, usage.completion_tokens, usage.expired) == (1, 20, 1)


def test_the_record_scan_settles_a_running_request_no_lease_check_saw():
    clock = FakeClock(datetime(2025, 5, 5, 12, tzinfo=UTC))
    lim = LocalAdmission(clock_us=clock, lease_ttl_s=10, record_grace_s=5)
    tenant = make_tenant(daily_token_budget=10_000)
    lim.admit_sync(tenant, "a", 10, 100)
    lim.renew_sync(tenant, "a", 4)
    lim.forget_tenant(tenant.id)  # its lease is gone from the live set
    clock.advance(16)
    lim.admit_sync(make_tenant(), "other", 1, 1)  # any call scans the records
    usage = lim.usage(tenant.id, 1)[-1]
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.expired) == (1, 10, 4, 1)


async def test_fail_static_admission_that_lapses_is_replayed_into_redis(redis_server_factory):
    """Admitted by the local limiter while Redis was down, then abandoned: the local settlement is
    buffered and replayed into Redis like the finish it never got."""
    from tenancy.settings import TenancySettings
    from tenancy.store_redis import RedisTenantStore

    server = redis_server_factory()
    settings = TenancySettings(
        store="redis",
        redis_url=server.url,
        key_prefix="loomsettle",
        secret=TEST_SECRET,
        redis_probe_interval_s=0.1,
        lease_ttl_s=LEASE_S,
    )
    enforcer = RedisAdmission.from_settings(settings)
    await enforcer.start()
    tenant = make_tenant("acme")
    try:
        assert (await enforcer.admit(tenant, rid(), 1, 1)).granted  # Redis answers
        server.kill()
        async with asyncio.timeout(15):
            a = await enforcer.admit(tenant, rid(), 8, 100)
            assert a.granted and a.backend.value == "fail_static"
            assert (await enforcer.renew(tenant, a.request_id, completion_tokens=6)).renewed

            async def settled_locally() -> bool:
                await enforcer.sweep([tenant])
                return enforcer.pending_finishes == 1

            await eventually(settled_locally, interval_s=0.05)
        server.start()
        await eventually(lambda: enforcer.pending_finishes == 0, timeout_s=15)
        admin = RedisTenantStore.from_settings(settings)
        try:
            usage = admin.usage("acme", 1)[-1]
        finally:
            admin.close()
        assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.expired) == (1, 8, 6, 1)
    finally:
        await enforcer.close()


async def test_admission_opens_its_redis_connections_at_start_not_in_a_burst(enforcer_factory):
    """A cold gateway's first burst would otherwise connect and handshake in its requests' path."""
    enforcer = enforcer_factory("redis", redis_max_connections=8)
    pool = enforcer._client.connection_pool

    def opened() -> int:
        conns = [*pool._available_connections, *pool._get_in_use_connections()]
        return sum(c.is_connected for c in conns)

    assert opened() == 0
    await enforcer.start()
    await eventually(lambda: opened() == 8)
    made = pool.make_connection
    calls = []
    pool.make_connection = lambda: calls.append(1) or made()
    tenant = make_tenant()
    burst = await asyncio.gather(*(enforcer.admit(tenant, rid(), 4, 4) for _ in range(24)))
    assert all(a.granted for a in burst)
    await asyncio.gather(*(enforcer.finish(tenant, a.request_id, 1) for a in burst))
    assert calls == [] and opened() == 8
