"""In-process admission: the same rules as the Redis script, for one process.

Lapsed leases are settled like the script settles them (see ``tenancy.admission``): when an admission,
renewal or finish of the tenant notices them, or by :meth:`LocalAdmission.sweep`. For the embedded
store, :meth:`LocalAdmission.state_snapshot` / :meth:`LocalAdmission.load_state` carry budgets and
usage across a restart (``tenancy.runtime`` writes them to the state file).

Used (1) as the limiter of the embedded single-node store, and (2) by ``RedisAdmission`` as its
fail-static fallback, where each gateway replica enforces its share of every limit. All state lives in
this object; it is safe to call from one event loop, and from threads (one lock, held for microseconds).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
    validate_renew,
)
from tenancy.models import DailyUsage, Tenant


def wall_clock_us() -> int:
    return time.time_ns() // 1000


ExpiredHook = Callable[[str, str, int, int], None]
"""Called (under the limiter's lock: keep it short) when a lapsed lease is settled:
``(tenant id, request id, prompt tokens, completion tokens)``."""


@dataclass(slots=True)
class _TenantState:
    rpm: qm.Bucket | None = None
    tpm: qm.Bucket | None = None
    tpm_limit: int | None = None
    """The tokens/min limit last applied to this tenant (a settlement outside any call of the tenant
    refunds its bucket with it)."""
    day: int = -1
    day_used: int = 0
    month: int = -1
    month_used: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expiry (us)
    # (expiry, request id) min-heap over ``leases``; entries made stale by a renewal or a release are
    # skipped lazily, so finding lapsed leases costs O(log n) per lease instead of a scan per call.
    expiries: list[tuple[int, str]] = field(default_factory=list)

    def add_lease(self, request_id: str, expiry: int) -> None:
        self.leases[request_id] = expiry
        heapq.heappush(self.expiries, (expiry, request_id))
        if len(self.expiries) > 2 * len(self.leases) + 64:  # too many stale entries: rebuild
            self.expiries = [(e, r) for r, e in self.leases.items()]
            heapq.heapify(self.expiries)

    def pop_lapsed(self, now: int, limit: int | None = None) -> list[str]:
        """Remove lapsed leases (expiry <= now), at most ``limit``; return their request ids."""
        heap, leases = self.expiries, self.leases
        out: list[str] = []
        while heap and heap[0][0] <= now and (limit is None or len(out) < limit):
            expiry, rid = heapq.heappop(heap)
            if leases.get(rid) == expiry:
                del leases[rid]
                out.append(rid)
        return out

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
    completion: int = 0
    """Running: completion tokens reported by the last renewal. Done: the count it was closed with."""
    outcome: Outcome | None = None


@dataclass(slots=True)
class _UsageCounters:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    errors: int = 0
    expired: int = 0


_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cancelled", "errors", "expired")


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
        sweep_max_settle: int = 1000,
        on_expired: ExpiredHook | None = None,
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
        self._sweep_max = sweep_max_settle
        self._on_expired = on_expired
        self._lock = threading.Lock()
        self._states: dict[str, _TenantState] = defaultdict(_TenantState)
        self._records: OrderedDict[tuple[str, str], _Record] = OrderedDict()
        self._usage: dict[tuple[str, str], _UsageCounters] = defaultdict(_UsageCounters)
        self._state_revision = 0
        self._pruned_day = -1  # the day usage older than the retention was last dropped
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

    async def renew(self, tenant: Tenant, request_id: str, completion_tokens: int | None = None) -> Renewal:
        return self.renew_sync(tenant, request_id, completion_tokens)

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

    async def sweep(self, tenants: Iterable[Tenant] = ()) -> int:
        """Settle lapsed leases of every tenant this limiter knows (``tenants`` is not needed here)."""
        return self.sweep_sync()

    # -- the rules ------------------------------------------------------------------------------
    def clock_us(self) -> int:
        return self._clock()

    def seed_buckets(
        self, tenant_id: str, rpm_level: float | None, tpm_level: float | None, now: int
    ) -> None:
        """Set a tenant's rate buckets to these levels (None: leave that one as it is), as the Redis
        enforcer does when it falls back here, so that quota spent there is not granted again."""
        with self._lock:
            st = self._states[tenant_id]
            if rpm_level is not None:
                st.rpm = qm.Bucket(rpm_level, now)
            if tpm_level is not None:
                st.tpm = qm.Bucket(tpm_level, now)

    def admit_sync(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int) -> Admission:
        validate_admission_args(request_id, prompt_tokens, max_tokens)
        limits = self._limits_for(tenant)
        cost = prompt_tokens + max_tokens
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            st = self._states[tenant.id]
            st.tpm_limit = limits.tokens_per_minute
            # Lapsed leases are settled first: their refunds count for this admission.
            self._settle_lapsed(tenant.id, st, now)
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
            self._state_revision += 1
            return self._granted(tenant, request_id, expiry, record, dup=False)

    def renew_sync(self, tenant: Tenant, request_id: str, completion_tokens: int | None = None) -> Renewal:
        validate_renew(request_id, completion_tokens)
        limits = self._limits_for(tenant)
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            key = (tenant.id, request_id)
            record = self._records.get(key)
            if record is None:
                return Renewal(False, reason="unknown")
            if record.done:
                return Renewal(False, reason="lost" if record.outcome is Outcome.EXPIRED else "finished")
            st = self._states[tenant.id]
            st.tpm_limit = limits.tokens_per_minute
            if completion_tokens is not None and completion_tokens != record.completion:
                record.completion = completion_tokens
                self._state_revision += 1
            # Our own lease leaves the live set here (re-added below), so that settling the tenant's
            # other lapsed leases never settles it: a holder that comes back in time decides below.
            current = st.leases.pop(request_id, None)
            self._settle_lapsed(tenant.id, st, now)
            reason = "ok"
            if current is None or current <= now:
                # Our lease lapsed (a long pause) and nobody settled it yet: take a slot again if one
                # is free; else the request is over, settled with what this renewal reports.
                if limits.max_concurrent is not None and len(st.leases) >= limits.max_concurrent:
                    self._settle(tenant.id, st, request_id, record, now)
                    return Renewal(False, reason="lost")
                reason = "reacquired"
            expiry = now + self._lease_ttl_us
            st.add_lease(request_id, expiry)
            record.expires_us = now + self._record_ttl_us
            self._records.move_to_end(key)  # keeps _records roughly in expiry order
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
        outcome = Outcome(outcome)
        limits = self._limits_for(tenant)
        with self._lock:
            now = self._clock()
            self._expire_records(now)
            record = self._records.get((tenant.id, request_id))
            if record is not None and record.done:
                return FinishResult(recorded=False, backend=self._mode)
            st = self._states[tenant.id]
            st.tpm_limit = limits.tokens_per_minute
            prompt = prompt_tokens if prompt_tokens is not None else (record.prompt if record else 0)
            refund = self._close(tenant.id, st, request_id, record, prompt, completion_tokens, outcome, now)
            self._settle_lapsed(tenant.id, st, now)
            return FinishResult(recorded=True, refunded_tokens=refund, backend=self._mode)

    def sweep_sync(self, max_settle: int | None = None) -> int:
        """Settle up to ``max_settle`` lapsed leases over all tenants; returns how many were settled."""
        budget = self._sweep_max if max_settle is None else max_settle
        settled = 0
        with self._lock:
            now = self._clock()
            settled += self._expire_records(now)
            for tenant_id, st in list(self._states.items()):
                if settled >= budget:
                    break
                earliest = st.earliest_expiry()
                if earliest is not None and earliest <= now:
                    settled += self._settle_lapsed(tenant_id, st, now, limit=budget - settled)
        return settled

    def _settle_lapsed(self, tenant_id: str, st: _TenantState, now: int, limit: int | None = None) -> int:
        """Settle the tenant's lapsed leases (the lock is held): each exactly like a finish with the
        tokens of its last renewal and ``Outcome.EXPIRED``."""
        settled = 0
        for rid in st.pop_lapsed(now, limit):
            record = self._records.get((tenant_id, rid))
            if record is not None and not record.done:
                self._settle(tenant_id, st, rid, record, now)
                settled += 1
        return settled

    def _settle(self, tenant_id: str, st: _TenantState, request_id: str, record: _Record, now: int) -> None:
        """Settle a running request whose lease lapsed: a finish with its last renewal's tokens."""
        self._close(tenant_id, st, request_id, record, record.prompt, record.completion, Outcome.EXPIRED, now)

    def _close(
        self,
        tenant_id: str,
        st: _TenantState,
        request_id: str,
        record: _Record | None,
        prompt: int,
        completion: int,
        outcome: Outcome,
        now: int,
    ) -> int:
        """End a request (the lock is held): correct its reservation to ``prompt + completion`` in the
        periods it was charged to (tokens/min too), meter usage, drop its lease, remember it as done.
        ``finish`` and the settlement of a lapsed lease both come here. Returns the refund."""
        key = (tenant_id, request_id)
        refund = 0
        if record is not None:
            delta = prompt + completion - record.reserved
            refund = -delta
            tpm = st.tpm_limit
            if tpm is not None and st.tpm is not None:
                st.tpm.refill(tpm, now)
                st.tpm.take(delta, tpm)
            if st.day == record.day:
                st.day_used = max(0, st.day_used + delta)
            if st.month == record.month:
                st.month_used = max(0, st.month_used + delta)
            record.done = True
            record.completion = completion
            record.outcome = outcome
            record.expires_us = now + self._done_ttl_us
            self._records.pop(key, None)
            self._records[key] = record  # at the end: records stay roughly in expiry order
        else:
            self._records[key] = _Record(
                tenant_id, 0, prompt, -1, -1, now + self._done_ttl_us, done=True, outcome=outcome
            )
        st.leases.pop(request_id, None)
        self._meter(tenant_id, now, prompt, completion, outcome)
        if outcome is Outcome.EXPIRED and self._on_expired is not None:
            self._on_expired(tenant_id, request_id, prompt, completion)
        return refund

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
                    DailyUsage(tenant_id=tenant_id, day=label, **{f: getattr(c, f) for f in _USAGE_FIELDS})
                )
            return rows

    def quota_status(self, tenant_id: str) -> dict[str, int]:
        """Live quota state, as ``RedisTenantStore.quota_status``: active leases and budget tokens used
        (reservations of running requests included) today and this month."""
        with self._lock:
            now = self._clock()
            st = self._states.get(tenant_id) or _TenantState()
            today = qm.day_index(now)
            return {
                "active_leases": sum(1 for exp in st.leases.values() if exp > now),
                "day_tokens_used": st.day_used if st.day == today else 0,
                "month_tokens_used": st.month_used if st.month == qm.month_index(today) else 0,
            }

    def _usage_snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (tid, label), c in self._usage.items():
            out.setdefault(tid, {})[label] = {f: getattr(c, f) for f in _USAGE_FIELDS}
        return out

    def _load_usage(self, snapshot: dict[str, dict[str, dict[str, int]]]) -> None:
        for tid, days in snapshot.items():
            for label, fields in days.items():
                c = self._usage[(tid, label)]
                for f in _USAGE_FIELDS:
                    setattr(c, f, getattr(c, f) + int(fields.get(f, 0)))

    def state_snapshot(self) -> dict[str, Any]:
        """What the embedded store persists, taken atomically (one lock)::

            {"usage":   {tenant: {"YYYY-MM-DD": {field: n}}},
             "budgets": {tenant: {"day": "YYYY-MM-DD", "day_used": n, "month": "YYYY-MM", "month_used": n}},
             "running": {tenant: {request id: {"reserved": n, "prompt": n, "completion": n,
                                               "day": "YYYY-MM-DD", "month": "YYYY-MM"}}}}

        ``budgets`` include the reservations of the requests in ``running``; :meth:`load_state`
        settles those (they belonged to a process that is gone), so the two always agree.
        Token buckets and leases are not part of it.
        """
        with self._lock:
            budgets: dict[str, dict[str, Any]] = {}
            for tid, st in self._states.items():
                if st.day >= 0 and (st.day_used or st.month_used):
                    budgets[tid] = {
                        "day": qm.day_label(st.day),
                        "day_used": st.day_used,
                        "month": qm.month_label(st.month),
                        "month_used": st.month_used,
                    }
            running: dict[str, dict[str, dict[str, Any]]] = {}
            for (tid, rid), r in self._records.items():
                if not r.done:
                    running.setdefault(tid, {})[rid] = {
                        "reserved": r.reserved,
                        "prompt": r.prompt,
                        "completion": r.completion,
                        "day": qm.day_label(r.day),
                        "month": qm.month_label(r.month),
                    }
            return {"usage": self._usage_snapshot(), "budgets": budgets, "running": running}

    def load_state(self, snapshot: dict[str, Any]) -> int:
        """Restore a :meth:`state_snapshot` (validated by the caller) into a fresh limiter.

        Usage is added; budgets are restored; requests that were running are settled at once, as
        lapsed leases are (tokens of their last renewal, ``Outcome.EXPIRED``): the process that ran
        them is gone. Returns how many were settled.
        """
        with self._lock:
            now = self._clock()
            self._load_usage(snapshot.get("usage") or {})
            for tid, b in (snapshot.get("budgets") or {}).items():
                st = self._states[tid]
                st.day, st.day_used = qm.day_from_label(b["day"]), int(b["day_used"])
                st.month, st.month_used = qm.month_from_label(b["month"]), int(b["month_used"])
            settled = 0
            for tid, requests in (snapshot.get("running") or {}).items():
                st = self._states[tid]
                for rid, r in requests.items():
                    if (tid, rid) in self._records:
                        continue
                    record = _Record(
                        tid,
                        int(r["reserved"]),
                        int(r["prompt"]),
                        qm.day_from_label(r["day"]),
                        qm.month_from_label(r["month"]),
                        now,
                        completion=int(r["completion"]),
                    )
                    self._settle(tid, st, rid, record, now)
                    settled += 1
            self._state_revision += 1
            return settled

    @property
    def state_revision(self) -> int:
        """Bumped on every change of what :meth:`state_snapshot` returns (admissions, renewals that
        report tokens, finishes, settlements): tells a persister whether there is anything to save."""
        return self._state_revision

    def prompt_of(self, tenant_id: str, request_id: str) -> int | None:
        """Prompt tokens reserved by a request this limiter admitted (``None`` if it does not know it)."""
        with self._lock:
            record = self._records.get((tenant_id, request_id))
            return record.prompt if record is not None else None

    def forget_tenant(self, tenant_id: str) -> None:
        with self._lock:
            self._states.pop(tenant_id, None)

    # -- internals ------------------------------------------------------------------------------
    def _meter(self, tenant_id: str, now: int, prompt: int, completion: int, outcome: Outcome) -> None:
        today = qm.day_index(now)
        c = self._usage[(tenant_id, qm.day_label(today))]
        self._state_revision += 1
        c.requests += 1
        c.prompt_tokens += prompt
        c.completion_tokens += completion
        if outcome is Outcome.CANCELLED:
            c.cancelled += 1
        elif outcome is Outcome.ERROR:
            c.errors += 1
        elif outcome is Outcome.EXPIRED:
            c.expired += 1
        if today != self._pruned_day:  # once a day: many tenants' live days are many keys to scan
            self._pruned_day = today
            cutoff = qm.day_label(today - self._retention_days)
            for k in [k for k in self._usage if k[1] < cutoff]:
                del self._usage[k]

    def _expire_records(self, now: int) -> int:
        """Drop finished records past their idempotency window; settle running ones unrenewed for a
        lease lifetime plus ``record_grace_s`` that no one settled (a backstop: their lease normally
        is settled when it lapses). Returns how many were settled.

        ``_records`` is kept roughly in expiry order (appended on admit, moved to the end on renew and
        finish), so the scan stops at the first live record.
        """
        settled = 0
        while self._records:
            key, record = next(iter(self._records.items()))
            if record.expires_us > now:
                break
            if record.done:
                del self._records[key]
                continue
            st = self._states[record.tenant_id]
            self._settle(key[0], st, key[1], record, now)
            settled += 1
        return settled

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
