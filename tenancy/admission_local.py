"""In-process admission: the same rules as the Redis script, for one process.

Used (1) as the limiter of the embedded single-node store, and (2) by ``RedisAdmission`` as its
fail-static fallback, where each gateway replica enforces its share of every limit. All state lives in
this object; it is safe to call from one event loop, and from threads (one lock, held for microseconds).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from tenancy import metrics
from tenancy import quota_math as qm
from tenancy.admission import (
    ActiveLease,
    Admission,
    EffectiveLimits,
    FinishResult,
    Limit,
    Outcome,
    QuotaMode,
    Renewal,
    validate_admission_args,
    validate_finish,
    validate_request_id,
)
from tenancy.models import DailyUsage, Tenant


def wall_clock_us() -> int:
    return time.time_ns() // 1000


@dataclass(slots=True)
class _TenantState:
    rpm: qm.Bucket | None = None
    tpm: qm.Bucket | None = None
    day: int = -1
    day_used: int = 0
    month: int = -1
    month_used: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expiry (us)
    # (expiry, request id) min-heap over ``leases``; entries made stale by a renewal or a release are
    # skipped lazily, so purging lapsed leases costs O(log n) per lease instead of a scan per call.
    expiries: list[tuple[int, str]] = field(default_factory=list)

    def add_lease(self, request_id: str, expiry: int) -> None:
        self.leases[request_id] = expiry
        heapq.heappush(self.expiries, (expiry, request_id))
        if len(self.expiries) > 2 * len(self.leases) + 64:  # too many stale entries: rebuild
            self.expiries = [(e, r) for r, e in self.leases.items()]
            heapq.heapify(self.expiries)

    def purge(self, now: int) -> None:
        """Drop lapsed leases (expiry <= now)."""
        heap, leases = self.expiries, self.leases
        while heap and heap[0][0] <= now:
            expiry, rid = heapq.heappop(heap)
            if leases.get(rid) == expiry:
                del leases[rid]

    def earliest_expiry(self) -> int | None:
        heap, leases = self.expiries, self.leases
        while heap and leases.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


@dataclass(slots=True)
class _Record:
    tenant_id: str
    reserved: int
    prompt: int
    day: int
    month: int
    expires_us: int
    done: bool = False


@dataclass(slots=True)
class _UsageCounters:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    errors: int = 0


class LocalAdmission:
    """The in-process :class:`~tenancy.admission.QuotaEnforcer`."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 30.0,
        record_grace_s: float = 300.0,
        finished_ttl_s: float = 3600.0,
        concurrency_retry_hint_s: float = 1.0,
        usage_retention_days: int = 400,
        clock_us: Callable[[], int] = wall_clock_us,
        mode: QuotaMode = QuotaMode.LOCAL,
        limits_for: Callable[[Tenant], EffectiveLimits] | None = None,
    ) -> None:
        self._lease_ttl_us = int(lease_ttl_s * 1e6)
        self._lease_ttl_s = lease_ttl_s
        self._record_ttl_us = int((lease_ttl_s + record_grace_s) * 1e6)
        self._done_ttl_us = int(finished_ttl_s * 1e6)
        self._conc_hint_us = int(concurrency_retry_hint_s * 1e6)
        self._retention_days = usage_retention_days
        self._clock = clock_us
        self._mode = mode
        self._limits_for = limits_for or (lambda t: EffectiveLimits.of(t.quotas))
        self._lock = threading.Lock()
        self._states: dict[str, _TenantState] = defaultdict(_TenantState)
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()
        self._usage: dict[tuple[str, str], _UsageCounters] = defaultdict(_UsageCounters)
        self._usage_revision = 0
        if mode is QuotaMode.LOCAL:
            for m in QuotaMode:
                metrics.QUOTA_MODE.labels(mode=m.value).set(1 if m is QuotaMode.LOCAL else 0)

    # -- QuotaEnforcer --------------------------------------------------------------------------
    @property
    def mode(self) -> QuotaMode:
        return self._mode

    @property
    def lease_ttl_s(self) -> float:
        return self._lease_ttl_s

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def hold(self, tenant: Tenant, admission: Admission) -> ActiveLease:
        return ActiveLease(self, tenant, admission)

    async def admit(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int) -> Admission:
        return self.admit_sync(tenant, request_id, prompt_tokens, max_tokens)

    async def renew(self, tenant: Tenant, request_id: str) -> Renewal:
        return self.renew_sync(tenant, request_id)

    async def finish(
        self,
        tenant: Tenant,
        request_id: str,
        completion_tokens: int,
        *,
        prompt_tokens: int | None = None,
        outcome: Outcome = Outcome.OK,
    ) -> FinishResult:
        return self.finish_sync(
            tenant, request_id, completion_tokens, prompt_tokens=prompt_tokens, outcome=outcome
        )

    # -- the rules ------------------------------------------------------------------------------
    def admit_sync(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int) -> Admission:
        validate_admission_args(request_id, prompt_tokens, max_tokens)
        limits = self._limits_for(tenant)
        cost = prompt_tokens + max_tokens
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            st = self._states[tenant.id]
            record = self._records.get((tenant.id, request_id))
            if record is not None:
                if not record.done:
                    return self._granted(tenant, request_id, st.leases.get(request_id, 0), record, dup=True)
                return self._refused(tenant, request_id, Limit.DUPLICATE_REQUEST, None)

            today = qm.day_index(now)
            this_month = qm.month_index(today)
            if st.day != today:
                st.day, st.day_used = today, 0
            if st.month != this_month:
                st.month, st.month_used = this_month, 0

            worst: Limit | None = None
            worst_wait: int | None = 0  # None: never

            def consider(limit: Limit, wait: int | None) -> None:
                nonlocal worst, worst_wait
                if wait == 0 or worst_wait is None:
                    return
                if wait is None or wait > worst_wait:
                    worst, worst_wait = limit, wait

            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            if rpm is not None:
                st.rpm = st.rpm or qm.Bucket.full(rpm, now)
                st.rpm.refill(rpm, now)
                consider(Limit.REQUESTS_PER_MINUTE, st.rpm.wait_us(rpm, 1))
            if tpm is not None:
                st.tpm = st.tpm or qm.Bucket.full(tpm, now)
                st.tpm.refill(tpm, now)
                consider(Limit.TOKENS_PER_MINUTE, st.tpm.wait_us(tpm, cost))
            if limits.daily_token_budget is not None:
                consider(
                    Limit.DAILY_BUDGET,
                    qm.budget_wait_us(
                        limits.daily_token_budget, st.day_used, cost, qm.next_day_start_us(now), now
                    ),
                )
            if limits.monthly_token_budget is not None:
                consider(
                    Limit.MONTHLY_BUDGET,
                    qm.budget_wait_us(
                        limits.monthly_token_budget, st.month_used, cost, qm.next_month_start_us(now), now
                    ),
                )
            st.purge(now)
            if limits.max_concurrent is not None and len(st.leases) >= limits.max_concurrent:
                wait = self._conc_hint_us
                earliest = st.earliest_expiry()
                if earliest is not None:
                    wait = min(wait, max(1, earliest - now))
                consider(Limit.CONCURRENCY, wait)

            if worst is not None:
                return self._refused(
                    tenant, request_id, worst, None if worst_wait is None else worst_wait / 1e6
                )

            st.day_used += cost
            st.month_used += cost
            if rpm is not None and st.rpm is not None:
                st.rpm.take(1, rpm)
            if tpm is not None and st.tpm is not None:
                st.tpm.take(cost, tpm)
            expiry = now + self._lease_ttl_us
            st.add_lease(request_id, expiry)
            record = _Record(tenant.id, cost, prompt_tokens, today, this_month, now + self._record_ttl_us)
            self._records[(tenant.id, request_id)] = record
            return self._granted(tenant, request_id, expiry, record, dup=False)

    def renew_sync(self, tenant: Tenant, request_id: str) -> Renewal:
        validate_request_id(request_id)
        limits = self._limits_for(tenant)
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            record = self._records.get((tenant.id, request_id))
            if record is None:
                return Renewal(False, reason="unknown")
            if record.done:
                return Renewal(False, reason="finished")
            st = self._states[tenant.id]
            reason = "ok"
            current = st.leases.get(request_id)
            if current is None or current <= now:
                st.purge(now)
                if limits.max_concurrent is not None and len(st.leases) >= limits.max_concurrent:
                    return Renewal(False, reason="lost")
                reason = "reacquired"
            expiry = now + self._lease_ttl_us
            st.add_lease(request_id, expiry)
            record.expires_us = now + self._record_ttl_us
            return Renewal(True, lease_expires_at=expiry / 1e6, reason=reason)

    def finish_sync(
        self,
        tenant: Tenant,
        request_id: str,
        completion_tokens: int,
        *,
        prompt_tokens: int | None = None,
        outcome: Outcome = Outcome.OK,
    ) -> FinishResult:
        validate_finish(request_id, completion_tokens, prompt_tokens)
        limits = self._limits_for(tenant)
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            key = (tenant.id, request_id)
            record = self._records.get(key)
            if record is not None and record.done:
                return FinishResult(recorded=False, backend=self._mode)
            st = self._states[tenant.id]
            prompt = prompt_tokens if prompt_tokens is not None else (record.prompt if record else 0)
            actual = prompt + completion_tokens
            refund = 0
            if record is not None:
                delta = actual - record.reserved
                refund = -delta
                tpm = limits.tokens_per_minute
                if tpm is not None and st.tpm is not None:
                    st.tpm.refill(tpm, now)
                    st.tpm.take(delta, tpm)
                if st.day == record.day:
                    st.day_used = max(0, st.day_used + delta)
                if st.month == record.month:
                    st.month_used = max(0, st.month_used + delta)
                self._records.move_to_end(key)
                record.done = True
                record.expires_us = now + self._done_ttl_us
            else:
                self._records[key] = _Record(tenant.id, 0, prompt, -1, -1, now + self._done_ttl_us, done=True)
            st.leases.pop(request_id, None)
            self._meter(tenant.id, now, prompt, completion_tokens, outcome)
            return FinishResult(recorded=True, refunded_tokens=refund, backend=self._mode)

    # -- usage ----------------------------------------------------------------------------------
    def usage(self, tenant_id: str, days: int = 30) -> list[DailyUsage]:
        """Metered usage of the last ``days`` UTC days (oldest first; days without usage included)."""
        with self._lock:
            today = qm.day_index(self._clock())
            rows = []
            for day in range(today - days + 1, today + 1):
                label = qm.day_label(day)
                c = self._usage.get((tenant_id, label), _UsageCounters())
                rows.append(
                    DailyUsage(
                        tenant_id=tenant_id,
                        day=label,
                        requests=c.requests,
                        prompt_tokens=c.prompt_tokens,
                        completion_tokens=c.completion_tokens,
                        cancelled=c.cancelled,
                        errors=c.errors,
                    )
                )
            return rows

    def usage_snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """All metered usage: ``{tenant: {day: {field: n}}}`` (for persisting the embedded store's usage)."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {}
            for (tid, label), c in self._usage.items():
                out.setdefault(tid, {})[label] = {
                    "requests": c.requests,
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                    "cancelled": c.cancelled,
                    "errors": c.errors,
                }
            return out

    def load_usage(self, snapshot: dict[str, dict[str, dict[str, int]]]) -> None:
        """Add previously persisted usage (see :meth:`usage_snapshot`) to the counters."""
        with self._lock:
            for tid, days in snapshot.items():
                for label, fields in days.items():
                    c = self._usage[(tid, label)]
                    c.requests += int(fields.get("requests", 0))
                    c.prompt_tokens += int(fields.get("prompt_tokens", 0))
                    c.completion_tokens += int(fields.get("completion_tokens", 0))
                    c.cancelled += int(fields.get("cancelled", 0))
                    c.errors += int(fields.get("errors", 0))

    @property
    def usage_revision(self) -> int:
        """Bumped on every metered finish: tells a persister whether there is anything new to save."""
        return self._usage_revision

    def prompt_of(self, tenant_id: str, request_id: str) -> int | None:
        """Prompt tokens reserved by a request this limiter admitted (``None`` if it does not know it)."""
        with self._lock:
            record = self._records.get((tenant_id, request_id))
            return record.prompt if record is not None else None

    def active_leases(self, tenant_id: str) -> int:
        with self._lock:
            now = self._clock()
            return sum(1 for exp in self._states[tenant_id].leases.values() if exp > now)

    def forget_tenant(self, tenant_id: str) -> None:
        with self._lock:
            self._states.pop(tenant_id, None)

    # -- internals ------------------------------------------------------------------------------
    def _meter(self, tenant_id: str, now: int, prompt: int, completion: int, outcome: Outcome) -> None:
        today = qm.day_index(now)
        c = self._usage[(tenant_id, qm.day_label(today))]
        self._usage_revision += 1
        c.requests += 1
        c.prompt_tokens += prompt
        c.completion_tokens += completion
        if outcome is Outcome.CANCELLED:
            c.cancelled += 1
        elif outcome is Outcome.ERROR:
            c.errors += 1
        cutoff = qm.day_label(today - self._retention_days)
        if len(self._usage) > 4 * self._retention_days:
            for k in [k for k in self._usage if k[1] < cutoff]:
                del self._usage[k]

    def _expire_records(self, now: int) -> None:
        """Drop finished records past their idempotency window, and running ones whose holder vanished.

        ``_records`` is kept roughly in expiry order (appended on admit, moved to the end on finish),
        so the scan stops at the first live record; a renewed record further in only delays the sweep.
        """
        while self._records:
            key, record = next(iter(self._records.items()))
            if record.expires_us > now:
                break
            del self._records[key]

    def _granted(
        self, tenant: Tenant, request_id: str, expiry: int, record: _Record, *, dup: bool
    ) -> Admission:
        metrics.admission_counter("granted", "", self._mode.value).inc()
        return Admission(
            granted=True,
            tenant_id=tenant.id,
            request_id=request_id,
            backend=self._mode,
            reserved_tokens=record.reserved,
            prompt_tokens=record.prompt,
            lease_expires_at=expiry / 1e6,
            duplicate=dup,
        )

    def _refused(
        self, tenant: Tenant, request_id: str, limit: Limit, retry_after_s: float | None
    ) -> Admission:
        metrics.admission_counter("refused", limit.value, self._mode.value).inc()
        return Admission(
            granted=False,
            tenant_id=tenant.id,
            request_id=request_id,
            backend=self._mode,
            limit=limit,
            retry_after_s=retry_after_s,
        )
