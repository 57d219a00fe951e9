"""Time-dependent rules, checked exactly with a fake clock on the in-process limiter, plus proof that
the Lua script's calendar arithmetic (day and month boundaries) matches Python's."""

from __future__ import annotations

from datetime import UTC, date, datetime

import redis
from tenancy_testlib import make_tenant

from tenancy.admission import EffectiveLimits, Limit
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import ADMISSION_LUA


class FakeClock:
    def __init__(self, when: datetime) -> None:
        self.us = int(when.timestamp() * 1_000_000)

    def __call__(self) -> int:
        return self.us

    def advance(self, seconds: float) -> None:
        self.us += int(seconds * 1_000_000)


def limiter(clock: FakeClock, **kwargs) -> LocalAdmission:
    return LocalAdmission(clock_us=clock, **kwargs)


def test_requests_refill_continuously():
    clock = FakeClock(datetime(2025, 3, 10, 12, tzinfo=UTC))
    lim = limiter(clock)
    tenant = make_tenant(requests_per_minute=60)
    assert all(lim.admit_sync(tenant, f"a{i}", 1, 1).granted for i in range(60))
    refused = lim.admit_sync(tenant, "x", 1, 1)
    assert refused.limit is Limit.REQUESTS_PER_MINUTE and refused.retry_after_s == 1.0
    clock.advance(0.999)
    assert not lim.admit_sync(tenant, "y", 1, 1).granted
    clock.advance(0.001)
    assert lim.admit_sync(tenant, "z", 1, 1).granted
    clock.advance(3600)  # a long idle period refills only up to one minute's worth
    assert sum(lim.admit_sync(tenant, f"b{i}", 1, 1).granted for i in range(100)) == 60


def test_tokens_retry_after_is_exact():
    clock = FakeClock(datetime(2025, 3, 10, 12, tzinfo=UTC))
    lim = limiter(clock)
    tenant = make_tenant(tokens_per_minute=6000)
    assert lim.admit_sync(tenant, "a", 1000, 4000).granted  # 1000 left
    refused = lim.admit_sync(tenant, "b", 1000, 2000)  # 2000 missing, 100 tokens/s
    assert refused.limit is Limit.TOKENS_PER_MINUTE and refused.retry_after_s == 20.0
    clock.advance(20)
    assert lim.admit_sync(tenant, "b", 1000, 2000).granted


def test_budgets_roll_over_at_utc_midnight_and_month_start():
    clock = FakeClock(datetime(2025, 1, 31, 23, 59, 30, tzinfo=UTC))
    lim = limiter(clock)
    tenant = make_tenant(daily_token_budget=1000, monthly_token_budget=1500)
    assert lim.admit_sync(tenant, "a", 500, 500).granted
    refused = lim.admit_sync(tenant, "b", 1, 1)
    assert refused.limit is Limit.DAILY_BUDGET and refused.retry_after_s == 30.0
    clock.advance(30)  # 2025-02-01 00:00:00: a new day and a new month
    assert lim.admit_sync(tenant, "b", 500, 500).granted
    assert lim.admit_sync(tenant, "c", 250, 250).granted is False  # daily 1000 used
    assert lim.finish_sync(tenant, "b", 500).recorded  # b used its whole reservation
    clock.advance(86400)  # Feb 2: day resets, month (1000 used of 1500) does not
    refused = lim.admit_sync(tenant, "d", 300, 300)
    assert refused.limit is Limit.MONTHLY_BUDGET
    assert refused.retry_after_s == (datetime(2025, 3, 1, tzinfo=UTC).timestamp() - clock.us / 1e6)


def test_refund_after_day_rollover_does_not_credit_the_new_day():
    clock = FakeClock(datetime(2025, 5, 5, 23, 59, tzinfo=UTC))
    lim = limiter(clock)
    tenant = make_tenant(daily_token_budget=1000)
    a = lim.admit_sync(tenant, "a", 100, 900)
    clock.advance(120)  # the request ends on the next day
    assert lim.admit_sync(tenant, "b", 100, 900).granted
    lim.finish_sync(tenant, a.request_id, 10)  # its refund belongs to yesterday, not today
    assert not lim.admit_sync(tenant, "c", 1, 1).granted


def test_finished_records_expire_after_the_idempotency_window():
    clock = FakeClock(datetime(2025, 5, 5, tzinfo=UTC))
    lim = limiter(clock, finished_ttl_s=60)
    tenant = make_tenant()
    lim.admit_sync(tenant, "a", 1, 1)
    assert lim.finish_sync(tenant, "a", 1).recorded
    clock.advance(30)
    assert not lim.finish_sync(tenant, "a", 1).recorded
    clock.advance(31)
    assert lim.admit_sync(tenant, "a", 1, 1).granted  # the id may be reused after the window
    assert len(lim._records) == 1


def test_fail_static_share():
    limits = EffectiveLimits(600, 100_000, 8, 10_000, None)
    share = limits.share(3, day_used=4000)
    assert share == EffectiveLimits(200, 33_333, 2, 2000, None)
    assert EffectiveLimits(1, None, 1, None, 50).share(4) == EffectiveLimits(1, None, 1, None, 12)


def test_lua_calendar_matches_python(redis_client: redis.Redis):
    script = redis_client.register_script(ADMISSION_LUA)
    epoch = date(1970, 1, 1).toordinal()
    days = list(range(date(1999, 12, 25).toordinal() - epoch, date(2001, 3, 5).toordinal() - epoch))
    days += [
        date(y, m, d).toordinal() - epoch
        for y in (2024, 2100, 2400)
        for m, d in ((2, 28), (2, 29 if y != 2100 else 28), (3, 1), (12, 31))
    ]
    pipe = redis_client.pipeline(transaction=False)
    for day in days:
        script(keys=["k1", "k2", "k3", "k4"], args=["civil", day], client=pipe)
    for day, (y, m, d, back, next_month, month_index) in zip(days, pipe.execute(), strict=True):
        expected = date.fromordinal(epoch + day)
        assert (y, m, d) == (expected.year, expected.month, expected.day)
        assert back == day
        first = date(expected.year + (expected.month == 12), expected.month % 12 + 1, 1)
        assert next_month == first.toordinal() - epoch
        assert month_index == expected.year * 12 + expected.month - 1


def test_usage_past_its_retention_is_dropped_once_a_day_not_scanned_at_every_finish():
    clock = FakeClock(datetime(2025, 3, 10, 12, tzinfo=UTC))
    lim = limiter(clock, usage_retention_days=2)
    tenants = [make_tenant() for _ in range(3)]

    def one_request_each(tag: str) -> None:
        for t in tenants:
            assert lim.admit_sync(t, tag, 1, 1).granted
            assert lim.finish_sync(t, tag, 1).recorded

    one_request_each("day0")
    clock.advance(86_400)
    one_request_each("day1")
    days = sorted({day for _, day in lim._usage})
    assert len(days) == 2 and len(lim._usage) == 6
    stale = ("planted", "2000-01-01")  # older than the retention, planted mid-day
    lim._usage[stale].requests = 1
    one_request_each("day1-again")
    assert stale in lim._usage  # a finish on the same day scans nothing
    clock.advance(3 * 86_400)  # the next day's first finish drops everything past the retention
    one_request_each("day4")
    assert stale not in lim._usage and days[0] not in {day for _, day in lim._usage}
    assert sum(u.requests for u in lim._usage.values()) == 3
