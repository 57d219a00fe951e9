"""Quota arithmetic of the in-process limiter; ``lua/admission.lua`` implements the same rules in Redis.

Times are integer microseconds since the Unix epoch (Redis ``TIME`` gives the same). Keeping these
rules in small pure functions lets the tests run one behavioural suite against both implementations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

MINUTE_US = 60_000_000
DAY_US = 86_400_000_000
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
# Floating-point slack when comparing bucket levels (levels are sums of integers and refills).
EPSILON = 1e-9


@dataclass(slots=True)
class Bucket:
    """A token bucket of capacity ``limit`` refilled at ``limit`` per minute."""

    level: float
    ts_us: int

    @classmethod
    def full(cls, limit: int, now_us: int) -> Bucket:
        return cls(float(limit), now_us)

    def refill(self, limit: int, now_us: int) -> None:
        if now_us > self.ts_us:
            self.level = min(float(limit), self.level + (now_us - self.ts_us) * limit / MINUTE_US)
            self.ts_us = now_us
        elif self.level > limit:  # the limit was lowered
            self.level = float(limit)

    def wait_us(self, limit: int, cost: int) -> int | None:
        """0 if ``cost`` fits now, else microseconds until it does; ``None`` if it never can."""
        if cost > limit:
            return None
        missing = cost - self.level
        if missing <= EPSILON:
            return 0
        return math.ceil(missing * MINUTE_US / limit)

    def take(self, cost: float, limit: int) -> None:
        """Remove ``cost`` (negative: give back), never above capacity; may go into debt below 0."""
        self.level = min(float(limit), self.level - cost)


def day_index(now_us: int) -> int:
    """Days since 1970-01-01 (UTC)."""
    return now_us // DAY_US


def day_label(day: int) -> str:
    return date.fromordinal(_EPOCH_ORDINAL + day).isoformat()


def month_index(day: int) -> int:
    d = date.fromordinal(_EPOCH_ORDINAL + day)
    return d.year * 12 + d.month - 1


def day_from_label(label: str) -> int:
    """Inverse of :func:`day_label` (raises ``ValueError`` on a malformed date)."""
    return date.fromisoformat(label).toordinal() - _EPOCH_ORDINAL


def month_label(month: int) -> str:
    """``YYYY-MM`` of a :func:`month_index`."""
    return f"{month // 12:04d}-{month % 12 + 1:02d}"


def month_from_label(label: str) -> int:
    """Inverse of :func:`month_label` (raises ``ValueError`` on a malformed month)."""
    year, sep, month = label.partition("-")
    well_formed = sep and len(year) == 4 and len(month) == 2 and (year + month).isdigit()
    if not well_formed or not 1 <= int(month) <= 12:
        raise ValueError(f"not a YYYY-MM month: {label!r}")
    return int(year) * 12 + int(month) - 1


def next_day_start_us(now_us: int) -> int:
    return (day_index(now_us) + 1) * DAY_US


def next_month_start_us(now_us: int) -> int:
    d = datetime.fromtimestamp(now_us / 1_000_000, tz=UTC).date()
    first = date(d.year + (d.month == 12), d.month % 12 + 1, 1)
    return (first.toordinal() - _EPOCH_ORDINAL) * DAY_US


def budget_wait_us(budget: int, used: int, cost: int, period_end_us: int, now_us: int) -> int | None:
    """0 if ``cost`` fits in what is left of ``budget``, else the wait until the period rolls over."""
    if cost > budget:
        return None
    if used + cost <= budget:
        return 0
    return max(1, period_end_us - now_us)


def days_back(today: date, days: int) -> list[date]:
    """``days`` dates ending with ``today``, oldest first."""
    return [today - timedelta(days=i) for i in range(days - 1, -1, -1)]
