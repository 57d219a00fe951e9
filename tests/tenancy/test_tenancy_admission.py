"""Admission semantics, run against both implementations (Redis Lua script and in-process limiter).

Time-independent by construction: the limits are such that the refill during a test (limit/60 per
second) cannot change an outcome, and lease expiry is awaited by polling, never by a timed assertion.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from tenancy_testlib import make_tenant, rid

from tenancy.admission import Limit, Outcome, QuotaMode
from tenancy.admission_local import LocalAdmission
from tenancy.errors import TenancyArgumentError
from tenancy.models import DailyUsage
from tenancy.settings import TenancySettings
from tenancy.store_redis import RedisTenantStore


def usage_today(enforcer, settings: TenancySettings, tenant_id: str) -> DailyUsage:
    if isinstance(enforcer, LocalAdmission):
        return enforcer.usage(tenant_id, 1)[-1]
    store = RedisTenantStore.from_settings(settings)
    try:
        return store.usage(tenant_id, 1)[-1]
    finally:
        store.close()


async def test_requests_per_minute(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(requests_per_minute=5)
    results = [await enforcer.admit(tenant, rid(), 10, 10) for _ in range(7)]
    assert [a.granted for a in results] == [True] * 5 + [False] * 2
    refused = results[-1]
    assert refused.limit is Limit.REQUESTS_PER_MINUTE
    # One request comes back every 60/5 = 12 s.
    assert 0 < refused.retry_after_s <= 12.0
    assert refused.retryable
    assert all(a.backend in (QuotaMode.LOCAL, QuotaMode.REDIS) for a in results)


async def test_tokens_per_minute_reserve_and_refund(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(tokens_per_minute=1000)
    a1 = await enforcer.admit(tenant, rid(), 100, 300)  # reserves 400
    a2 = await enforcer.admit(tenant, rid(), 100, 300)  # reserves 400 -> 200 left
    a3 = await enforcer.admit(tenant, "third", 100, 300)
    assert a1.granted and a2.granted and a1.reserved_tokens == 400
    assert not a3.granted and a3.limit is Limit.TOKENS_PER_MINUTE
    assert 0 < a3.retry_after_s <= (200 / 1000) * 60  # 200 tokens missing at 1000/min

    done = await enforcer.finish(tenant, a1.request_id, 50)  # used 150 of 400: refund 250
    assert done.recorded and done.refunded_tokens == 250
    again = await enforcer.finish(tenant, a1.request_id, 50)  # idempotent: no second refund
    assert not again.recorded and again.refunded_tokens == 0

    assert (await enforcer.admit(tenant, rid(), 100, 300)).granted  # 450 available now
    after = await enforcer.admit(tenant, rid(), 100, 300)  # only ~50 left
    assert not after.granted and after.limit is Limit.TOKENS_PER_MINUTE


async def test_refusal_changes_nothing(make_enforcer):
    """All-or-nothing: a request refused on one limit does not consume any other."""
    enforcer = make_enforcer()
    tenant = make_tenant(requests_per_minute=10, tokens_per_minute=10_000, max_concurrent=1)
    first = await enforcer.admit(tenant, rid(), 10, 10)
    assert first.granted
    for _ in range(20):
        refused = await enforcer.admit(tenant, rid(), 10, 10)
        assert refused.limit is Limit.CONCURRENCY
    await enforcer.finish(tenant, first.request_id, 10)
    granted = 0
    for _ in range(12):
        a = await enforcer.admit(tenant, rid(), 10, 10)
        if a.granted:
            granted += 1
            await enforcer.finish(tenant, a.request_id, 10)
        else:
            assert a.limit is Limit.REQUESTS_PER_MINUTE
    assert granted == 9  # 10 per minute, one used by `first`; the 20 refusals took nothing


async def test_longest_wait_is_reported(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(requests_per_minute=1, max_concurrent=1)
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted
    refused = await enforcer.admit(tenant, rid(), 1, 1)
    # Both limits are exhausted: rpm needs ~60 s, concurrency ~1 s (the hint): report rpm.
    assert refused.limit is Limit.REQUESTS_PER_MINUTE
    assert refused.retry_after_s > 30


async def test_concurrency_and_release(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(max_concurrent=2)
    first = await enforcer.admit(tenant, rid(), 1, 1)
    second = await enforcer.admit(tenant, rid(), 1, 1)
    third = await enforcer.admit(tenant, rid(), 1, 1)
    assert first.granted and second.granted and not third.granted
    assert third.limit is Limit.CONCURRENCY
    assert 0 < third.retry_after_s <= 1.0  # the configured hint
    await enforcer.finish(tenant, second.request_id, 1, outcome=Outcome.CANCELLED)
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted  # the slot came back at once


async def test_lease_expires_without_renewal(make_enforcer):
    enforcer = make_enforcer(lease_ttl_s=1.0)
    tenant = make_tenant(max_concurrent=1)
    held = await enforcer.admit(tenant, rid(), 1, 1)
    assert held.granted
    refused = await enforcer.admit(tenant, rid(), 1, 1)
    assert refused.limit is Limit.CONCURRENCY and refused.retry_after_s <= 1.0
    for _ in range(200):  # wait for the lapse by polling (no timing assertion)
        await asyncio.sleep(0.05)
        if (await enforcer.admit(tenant, rid(), 1, 1)).granted:
            break
    else:
        pytest.fail("the unrenewed lease never expired")
    # The lapsed holder cannot renew: its slot was taken meanwhile.
    renewal = await enforcer.renew(tenant, held.request_id)
    assert not renewal.renewed and renewal.reason == "lost"


async def test_renew(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(max_concurrent=1)
    a = await enforcer.admit(tenant, rid(), 1, 1)
    await asyncio.sleep(0.01)
    renewal = await enforcer.renew(tenant, a.request_id)
    assert renewal.renewed and renewal.lease_expires_at > a.lease_expires_at
    assert (await enforcer.renew(tenant, "never-admitted")).reason == "unknown"
    await enforcer.finish(tenant, a.request_id, 1)
    assert (await enforcer.renew(tenant, a.request_id)).reason == "finished"


async def test_daily_and_monthly_budgets(make_enforcer):
    enforcer = make_enforcer()
    now = datetime.now(UTC)
    to_midnight = (
        datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1) - now
    ).total_seconds()
    tenant = make_tenant(daily_token_budget=1000)
    assert (await enforcer.admit(tenant, rid(), 200, 200)).granted
    second = await enforcer.admit(tenant, rid(), 200, 200)
    refused = await enforcer.admit(tenant, rid(), 200, 200)
    assert second.granted and refused.limit is Limit.DAILY_BUDGET
    assert to_midnight - 5 < refused.retry_after_s <= to_midnight + 5
    # The budget counts actual usage once a request ends: unused reservations come back.
    await enforcer.finish(tenant, second.request_id, 0)  # used 200 of 400
    assert (await enforcer.admit(tenant, rid(), 200, 200)).granted

    monthly = make_tenant(monthly_token_budget=1000)
    assert (await enforcer.admit(monthly, rid(), 500, 500)).granted
    refused = await enforcer.admit(monthly, rid(), 1, 1)
    assert refused.limit is Limit.MONTHLY_BUDGET
    first_of_next = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=UTC)
    assert abs(refused.retry_after_s - (first_of_next - now).total_seconds()) < 5


async def test_request_larger_than_a_limit_is_never_retryable(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(tokens_per_minute=100)
    refused = await enforcer.admit(tenant, rid(), 80, 80)
    assert not refused.granted and refused.limit is Limit.TOKENS_PER_MINUTE
    assert refused.retry_after_s is None and not refused.retryable


async def test_idempotent_admit(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant(requests_per_minute=2)
    first = await enforcer.admit(tenant, "same-id", 10, 20)
    again = await enforcer.admit(tenant, "same-id", 10, 20)
    assert first.granted and again.granted and again.duplicate and not first.duplicate
    assert again.reserved_tokens == 30 and again.prompt_tokens == 10
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted  # the duplicate took no request
    await enforcer.finish(tenant, "same-id", 5)
    reused = await enforcer.admit(tenant, "same-id", 10, 20)
    assert not reused.granted and reused.limit is Limit.DUPLICATE_REQUEST


async def test_usage_metering(make_enforcer, settings):
    enforcer = make_enforcer()
    tenant = make_tenant()
    for completion, outcome in ((7, Outcome.OK), (3, Outcome.CANCELLED), (0, Outcome.ERROR)):
        a = await enforcer.admit(tenant, rid(), 11, 100)
        await enforcer.finish(tenant, a.request_id, completion, outcome=outcome)
    usage = usage_today(enforcer, settings, tenant.id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (3, 33, 10)
    assert (usage.cancelled, usage.errors) == (1, 1)


async def test_cancelled_stream_releases_its_slot_at_once(make_enforcer, settings):
    enforcer = make_enforcer()
    tenant = make_tenant(max_concurrent=1)
    admission = await enforcer.admit(tenant, rid(), 12, 100)
    streaming = asyncio.Event()

    async def stream() -> None:
        async with enforcer.hold(tenant, admission) as lease:
            lease.completion_tokens += 4
            streaming.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(stream())
    await streaming.wait()
    assert not (await enforcer.admit(tenant, rid(), 1, 1)).granted
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted
    usage = usage_today(enforcer, settings, tenant.id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.cancelled) == (1, 12, 4, 1)


async def test_hold_renews_and_finishes_once(make_enforcer):
    enforcer = make_enforcer(lease_ttl_s=1.0)
    tenant = make_tenant(max_concurrent=1)
    admission = await enforcer.admit(tenant, rid(), 1, 10)
    async with enforcer.hold(tenant, admission) as lease:
        # More than a lease lifetime passes; the background renewal keeps the slot ours.
        for _ in range(6):
            await asyncio.sleep(0.25)
            assert not (await enforcer.admit(tenant, rid(), 1, 1)).granted
        lease.completion_tokens = 3
    assert lease.finished and not lease.lost
    first = await lease.finish()
    assert first.recorded and (await lease.finish()) is first  # finishing again is a no-op
    assert (await enforcer.admit(tenant, rid(), 1, 1)).granted


async def test_invalid_arguments(make_enforcer):
    enforcer = make_enforcer()
    tenant = make_tenant()
    for args in (("", 1, 1), ("ok", -1, 1), ("ok", 1, 0), ("bad id with spaces", 1, 1), ("x" * 200, 1, 1)):
        with pytest.raises(TenancyArgumentError):
            await enforcer.admit(tenant, *args)
    with pytest.raises(TenancyArgumentError):
        await enforcer.finish(tenant, "ok", -3)
