"""Cluster-wide admission: one atomic Lua call per operation, plus the behaviour while Redis is down.

Healthy: every ``admit``/``renew``/``finish`` is one EVALSHA of ``lua/admission.lua`` on the tenant's
hash slot, so limits hold across every gateway replica.

Unreachable (connection refused, timeout, failover in progress): the call fails within the client's
short timeouts, the enforcer switches mode, logs the transition, sets the gauge, and

* ``fail_static`` (default): admits through an in-process :class:`LocalAdmission` that enforces this
  replica's share of each limit (limit / ``gateway_replicas``; budgets: what was left at the last Redis
  answer, divided likewise). Finishes of those requests are metered locally and their usage is replayed
  into Redis later.
* ``fail_closed``: refuses with ``Limit.QUOTA_STORE_UNAVAILABLE``.

While down it does not touch Redis on every request (that would add a timeout to each): one call per
``redis_probe_interval_s`` probes it (and a background probe does the same when started). On recovery
the buffered finishes are replayed; they are idempotent by request id, so a replay never double-counts.

Lapsed leases (a gateway died mid-stream) are settled by the script whenever a call of the tenant
notices them, and by :meth:`RedisAdmission.sweep`, which the runtime calls periodically over the
tenants it knows (a bounded number per call, one pipelined round trip). A request admitted locally in
fail-static mode whose lease lapses is settled by the local limiter and its usage replayed into Redis
like a finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aioredis

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
from tenancy.admission_local import LocalAdmission
from tenancy.models import Tenant
from tenancy.redis_client import async_client
from tenancy.redis_layout import RedisLayout
from tenancy.settings import FailureMode, TenancySettings

log = logging.getLogger(__name__)

ADMISSION_LUA = resources.files("tenancy").joinpath("lua/admission.lua").read_text(encoding="utf-8")
_STATE_TTL_MS = 40 * 86_400_000  # outlives a calendar month, so budgets survive an idle tenant
# Redis error replies that mean "not available right now" rather than "bug in the script".
_TRANSIENT_REPLIES = (
    "OOM",
    "READONLY",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "NOREPLICAS",
    "BUSY",
    "TRYAGAIN",
    "LOADING",
)
_LIMIT_BY_NAME = {limit.value: limit for limit in Limit}


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(
        exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | TimeoutError | OSError
    ):
        return True
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, redis.exceptions.TimeoutError | TimeoutError)


def _level(raw: Any) -> float | None:
    """A bucket level as the script returns it: its decimal text, empty for a limit not set."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return float(text) if text else None


def _store_unavailable(
    tenant: Tenant, request_id: str, backend: QuotaMode, retry_after_s: float
) -> Admission:
    """A refusal because Redis did not answer, counted under the mode that refused it."""
    metrics.admission_counter("refused", Limit.QUOTA_STORE_UNAVAILABLE.value, backend.value).inc()
    return Admission(
        granted=False,
        tenant_id=tenant.id,
        request_id=request_id,
        backend=backend,
        limit=Limit.QUOTA_STORE_UNAVAILABLE,
        retry_after_s=retry_after_s,
    )


def _opt(value: int | None) -> int:
    """Unlimited is sent to the script as -1."""
    return -1 if value is None else value


@dataclass(slots=True)
class _PendingFinish:
    tenant_id: str
    request_id: str
    completion_tokens: int
    prompt_tokens: int
    outcome: Outcome
    tokens_per_minute: int | None
    orphan: bool


@dataclass(slots=True)
class _BudgetSeen:
    day: int
    day_used: int
    month: int
    month_used: int


class RedisAdmission:
    """The Redis-backed :class:`~tenancy.admission.QuotaEnforcer` (asyncio)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        settings: TenancySettings | None = None,
        layout: RedisLayout | None = None,
    ) -> None:
        s = settings or TenancySettings()
        self._client = client
        self._script = client.register_script(ADMISSION_LUA)
        self._layout = layout or RedisLayout(s.key_prefix)
        self._failure_mode = s.failure_mode
        self._replicas = s.gateway_replicas
        self._probe_interval_s = s.redis_probe_interval_s
        # Backstop over the socket timeouts (connect + one reconnect + read), never reached normally.
        self._deadline_s = s.redis_timeout_s * 4
        self._lease_ttl_s = s.lease_ttl_s
        self._lease_ttl_us = int(s.lease_ttl_s * 1e6)
        self._done_ttl_ms = int(s.finished_ttl_s * 1000)
        self._conc_hint_us = int(s.concurrency_retry_hint_s * 1e6)
        self._retention_days = s.usage_retention_days
        self._settle_batch = s.lease_settle_batch
        self._sweep_tenants = s.lease_sweep_tenants
        self._sweep_cursor = ""
        self._fallback = LocalAdmission(
            lease_ttl_s=s.lease_ttl_s,
            record_grace_s=s.record_grace_s,
            finished_ttl_s=s.finished_ttl_s,
            concurrency_retry_hint_s=s.concurrency_retry_hint_s,
            usage_retention_days=s.usage_retention_days,
            mode=QuotaMode.FAIL_STATIC,
            limits_for=self._local_share,
            on_expired=self._local_lease_expired,
        )
        self._healthy = True
        self._next_probe = 0.0
        self._local_ids: set[tuple[str, str]] = set()
        self._pending: deque[_PendingFinish] = deque()
        self._pending_max = s.pending_finish_max
        self._budget_seen: dict[str, _BudgetSeen] = {}
        # Each tenant's rate buckets (requests, tokens) as Redis's last admit left them; None: no limit.
        self._levels_seen: dict[str, tuple[float | None, float | None]] = {}
        self._timeouts_in_a_row = 0
        self._timeouts_to_degrade = s.redis_timeouts_to_degrade
        self._probe_task: asyncio.Task[None] | None = None
        self._warm_task: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[int] | None = None
        self._owns_client = False
        self._set_mode_gauge()

    @classmethod
    def from_settings(cls, settings: TenancySettings) -> RedisAdmission:
        client = async_client(
            settings.redis_dsn,
            timeout_s=settings.redis_timeout_s,
            max_connections=settings.redis_max_connections,
        )
        enforcer = cls(client, settings=settings)
        enforcer._owns_client = True
        return enforcer

    # -- mode -----------------------------------------------------------------------------------
    @property
    def mode(self) -> QuotaMode:
        """``redis`` while Redis answers, else the configured failure mode."""
        if self._healthy:
            return QuotaMode.REDIS
        return (
            QuotaMode.FAIL_STATIC if self._failure_mode is FailureMode.FAIL_STATIC else QuotaMode.FAIL_CLOSED
        )

    @property
    def lease_ttl_s(self) -> float:
        return self._lease_ttl_s

    @property
    def pending_finishes(self) -> int:
        return len(self._pending)

    def _set_mode_gauge(self) -> None:
        current = self.mode
        for m in (QuotaMode.REDIS, QuotaMode.FAIL_STATIC, QuotaMode.FAIL_CLOSED):
            metrics.QUOTA_MODE.labels(mode=m.value).set(1 if m is current else 0)

    def _mark_down(self, op: str, exc: BaseException) -> bool:
        """Count a failed call; True once admission is degraded (fail-static or fail-closed).

        A refused or reset connection is an outage at once. A timeout may be this gateway's own load
        (its event loop late, its connection pool busy) as much as Redis's: only
        ``redis_timeouts_to_degrade`` of them in a row degrade admission; until then each call that
        timed out is refused as retryable, and limits stay Redis's.
        """
        metrics.REDIS_ERRORS.labels(op=op).inc()
        if self._healthy and _is_timeout(exc):
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row < self._timeouts_to_degrade:
                return False
        self._next_probe = time.monotonic() + self._probe_interval_s
        if self._healthy:
            self._healthy = False
            self._seed_local_buckets()
            self._set_mode_gauge()
            log.warning(
                "quota store unreachable (%s during %s: %s); admission mode is now %s%s",
                type(exc).__name__,
                op,
                exc,
                self.mode.value,
                f" (local limits, 1/{self._replicas} share per replica)"
                if self.mode is QuotaMode.FAIL_STATIC
                else " (refusing all admissions)",
            )
        return True

    def _answered(self) -> None:
        """Redis answered a call: timeouts in a row start over; a degraded mode ends; finishes
        buffered meanwhile are replayed."""
        self._timeouts_in_a_row = 0
        if not self._healthy:
            self._healthy = True
            self._set_mode_gauge()
            log.warning(
                "quota store answers again; admission mode is back to redis (%d buffered finishes to replay)",
                len(self._pending),
            )
        if self._pending and (self._replay_task is None or self._replay_task.done()):
            self._replay_task = asyncio.get_running_loop().create_task(self.replay_pending())

    def _seed_local_buckets(self) -> None:
        """The local limiter's rate buckets start where Redis's last answers left each tenant's (this
        replica's share of it), not full: a full bucket would grant again what was just spent."""
        now = self._fallback.clock_us()
        for tenant_id, (rpm_level, tpm_level) in self._levels_seen.items():
            share = 1 / self._replicas
            self._fallback.seed_buckets(
                tenant_id,
                None if rpm_level is None else rpm_level * share,
                None if tpm_level is None else tpm_level * share,
                now,
            )

    def _should_try_redis(self) -> bool:
        if self._healthy:
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + self._probe_interval_s  # this call is the probe; others keep waiting
        return True

    async def _eval(self, keys: list[str], args: list[Any]) -> Any:
        async with asyncio.timeout(self._deadline_s):
            return await self._script(keys=keys, args=args)

    def _keys(self, tenant_id: str, request_id: str) -> list[str]:
        lay = self._layout
        return [
            lay.quota_state(tenant_id),
            lay.leases(tenant_id),
            lay.request(tenant_id, request_id),
            lay.usage(tenant_id),
        ]

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the pool's connections, and start the background probe that notices recovery (and
        replays finishes) without traffic."""
        if self._warm_task is None:  # in the background: a Redis not answering must not hold the start
            self._warm_task = asyncio.get_running_loop().create_task(
                self._open_connections(), name="quota-warm"
            )
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(), name="quota-probe")

    async def _open_connections(self) -> None:
        """Every connection of the pool, opened now (one concurrent PING each). Otherwise a cold
        gateway's first burst connects and handshakes in its requests' path: 96 one-token streams
        at once cost the gateway's loop 18-24% more CPU. Redis down now is not an error here:
        admission degrades on its first request as it would at any time."""
        if not self._owns_client:  # a caller's client (tests): its pool is the caller's to size
            return
        size = self._client.connection_pool.max_connections
        try:
            async with asyncio.timeout(self._deadline_s * 2):
                pings = (self._client.ping() for _ in range(size))
                results = await asyncio.gather(*pings, return_exceptions=True)
        except TimeoutError:
            log.warning("Redis did not open admission's %d connections at start in time", size)
            return
        failed = sum(isinstance(r, BaseException) for r in results)
        if failed:
            log.warning("%d of %d Redis connections for admission could not be opened at start", failed, size)

    async def close(self) -> None:
        for task in (self._probe_task, self._replay_task, self._warm_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._probe_task = self._replay_task = self._warm_task = None
        if self._pending:
            log.warning("closing with %d buffered finishes not replayed (usage lost)", len(self._pending))
        if self._owns_client:
            await self._client.aclose()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            if self._healthy and not self._pending:
                self._prune_local_ids()
                continue
            try:
                async with asyncio.timeout(self._deadline_s):
                    await self._client.ping()
            except Exception as exc:
                if not _is_unavailable(exc):
                    log.exception("quota store probe failed")
                continue
            self._answered()

    def hold(self, tenant: Tenant, admission: Admission) -> ActiveLease:
        return ActiveLease(self, tenant, admission)

    def _prune_local_ids(self) -> None:
        """Forget locally admitted requests the fallback no longer knows (never finished, expired)."""
        if not self._local_ids:
            return
        waiting = {(p.tenant_id, p.request_id) for p in self._pending}
        self._local_ids = {
            key
            for key in self._local_ids
            if key in waiting or self._fallback.prompt_of(key[0], key[1]) is not None
        }

    # -- settling lapsed leases ----------------------------------------------------------------
    async def sweep(self, tenants: Iterable[Tenant] = ()) -> int:
        """Settle lapsed leases: the local limiter's (fail-static admissions), then, if Redis answers,
        those of the next ``lease_sweep_tenants`` of ``tenants`` in id order (round robin over calls),
        at most ``lease_settle_batch`` each, in one pipelined round trip. Returns how many were settled.
        """
        settled = self._fallback.sweep_sync()
        if not self._healthy:
            return settled  # the probe notices recovery; sweeping resumes then
        by_id = {t.id: t for t in tenants}
        if not by_id:
            return settled
        ids = sorted(by_id)
        start = next((i for i, tid in enumerate(ids) if tid > self._sweep_cursor), 0)
        batch = (ids[start:] + ids[:start])[: self._sweep_tenants]
        self._sweep_cursor = batch[-1]
        pipe = self._client.pipeline(transaction=False)
        for tid in batch:
            lay = self._layout
            args: list[Any] = [
                "sweep",
                "",
                _opt(by_id[tid].quotas.tokens_per_minute),
                _STATE_TTL_MS,
                self._done_ttl_ms,
                self._retention_days,
                self._settle_batch,
            ]
            keys = [lay.quota_state(tid), lay.leases(tid), lay.request_prefix(tid), lay.usage(tid)]
            await self._script(keys=keys, args=args, client=pipe)
        try:
            async with asyncio.timeout(self._deadline_s * 2):
                replies = await pipe.execute()
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            self._mark_down("sweep", exc)
            return settled
        swept = sum(int(reply[0]) for reply in replies)
        if swept:
            log.info("settled %d lapsed leases (holders gone without finishing)", swept)
        return settled + swept

    def _local_lease_expired(self, tenant_id: str, request_id: str, prompt: int, completion: int) -> None:
        """The fallback settled a lapsed lease: if it was admitted locally during an outage, its usage
        goes to Redis like the finish it never got (buffered; replayed when Redis answers)."""
        if (tenant_id, request_id) in self._local_ids:
            self._buffer(
                _PendingFinish(tenant_id, request_id, completion, prompt, Outcome.EXPIRED, None, orphan=True)
            )

    # -- admit ------------------------------------------------------------------------------------
    async def admit(self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int) -> Admission:
        validate_admission_args(request_id, prompt_tokens, max_tokens)
        if not self._should_try_redis():
            return self._admit_degraded(tenant, request_id, prompt_tokens, max_tokens)
        q = tenant.quotas
        args: list[Any] = [
            "admit",
            request_id,
            _opt(q.requests_per_minute),
            _opt(q.tokens_per_minute),
            _opt(q.max_concurrent),
            _opt(q.daily_token_budget),
            _opt(q.monthly_token_budget),
            prompt_tokens,
            max_tokens,
            self._lease_ttl_us,
            self._conc_hint_us,
            _STATE_TTL_MS,
            self._done_ttl_ms,
            self._retention_days,
            self._settle_batch,
        ]
        try:
            reply = await self._eval(self._keys(tenant.id, request_id), args)
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            if self._mark_down("admit", exc):
                return self._admit_degraded(tenant, request_id, prompt_tokens, max_tokens)
            return _store_unavailable(tenant, request_id, QuotaMode.REDIS, self._probe_interval_s)
        self._answered()
        return self._parse_admit(tenant, request_id, reply)

    def _parse_admit(self, tenant: Tenant, request_id: str, reply: list[Any]) -> Admission:
        granted = reply[0] == 1
        tag = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        day_used, month_used = (int(reply[4]), int(reply[5])) if granted else (int(reply[3]), int(reply[4]))
        now_us = time.time_ns() // 1000
        day = qm.day_index(now_us)
        self._budget_seen[tenant.id] = _BudgetSeen(day, day_used, qm.month_index(day), month_used)
        levels = reply[7:9] if granted else reply[5:7]
        if len(levels) == 2:
            self._levels_seen[tenant.id] = (_level(levels[0]), _level(levels[1]))
        if granted:
            metrics.admission_counter("granted", "", "redis").inc()
            return Admission(
                granted=True,
                tenant_id=tenant.id,
                request_id=request_id,
                backend=QuotaMode.REDIS,
                reserved_tokens=int(reply[3]),
                prompt_tokens=int(reply[6]),
                lease_expires_at=int(reply[2]) / 1e6,
                duplicate=tag == "dup",
            )
        limit = _LIMIT_BY_NAME[tag]
        wait_us = int(reply[2])
        metrics.admission_counter("refused", limit.value, "redis").inc()
        return Admission(
            granted=False,
            tenant_id=tenant.id,
            request_id=request_id,
            backend=QuotaMode.REDIS,
            limit=limit,
            retry_after_s=None if wait_us < 0 else wait_us / 1e6,
        )

    def _admit_degraded(
        self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Admission:
        if self._failure_mode is FailureMode.FAIL_CLOSED:
            wait = max(0.001, self._next_probe - time.monotonic())
            return _store_unavailable(tenant, request_id, QuotaMode.FAIL_CLOSED, wait)
        admission = self._fallback.admit_sync(tenant, request_id, prompt_tokens, max_tokens)
        if admission.granted:
            self._local_ids.add((tenant.id, request_id))
        return admission

    def _local_share(self, tenant: Tenant) -> EffectiveLimits:
        limits = EffectiveLimits.of(tenant.quotas)
        seen = self._budget_seen.get(tenant.id)
        day_used = month_used = 0
        if seen is not None:
            today = qm.day_index(time.time_ns() // 1000)
            day_used = seen.day_used if seen.day == today else 0
            month_used = seen.month_used if seen.month == qm.month_index(today) else 0
        return limits.share(self._replicas, day_used=day_used, month_used=month_used)

    # -- renew ------------------------------------------------------------------------------------
    async def renew(self, tenant: Tenant, request_id: str, completion_tokens: int | None = None) -> Renewal:
        validate_renew(request_id, completion_tokens)
        if (tenant.id, request_id) in self._local_ids:
            return self._fallback.renew_sync(tenant, request_id, completion_tokens)
        if not self._should_try_redis():
            return Renewal(False, reason="unavailable")
        args: list[Any] = [
            "renew",
            request_id,
            _opt(tenant.quotas.max_concurrent),
            self._lease_ttl_us,
            -1 if completion_tokens is None else completion_tokens,
            _opt(tenant.quotas.tokens_per_minute),
            _STATE_TTL_MS,
            self._done_ttl_ms,
            self._retention_days,
            self._settle_batch,
        ]
        try:
            reply = await self._eval(self._keys(tenant.id, request_id), args)
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            self._mark_down("renew", exc)
            return Renewal(False, reason="unavailable")
        self._answered()
        tag = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        if reply[0] == 1:
            return Renewal(True, lease_expires_at=int(reply[2]) / 1e6, reason=tag)
        return Renewal(False, reason=tag)

    # -- finish -----------------------------------------------------------------------------------
    async def finish(
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
        key = (tenant.id, request_id)
        if key in self._local_ids:
            # Admitted locally during an outage: meter locally, then copy the usage into Redis. The id
            # stays in _local_ids until that copy lands, so a repeated finish hits the local no-op.
            if prompt_tokens is None:
                prompt_tokens = self._fallback.prompt_of(tenant.id, request_id) or 0
            local = self._fallback.finish_sync(
                tenant, request_id, completion_tokens, prompt_tokens=prompt_tokens, outcome=outcome
            )
            if local.recorded:
                pending = _PendingFinish(
                    tenant.id,
                    request_id,
                    completion_tokens,
                    prompt_tokens,
                    outcome,
                    tenant.quotas.tokens_per_minute,
                    orphan=True,
                )
                if self._healthy and await self._send_finish(pending):
                    self._local_ids.discard(key)
                else:
                    self._buffer(pending)
            return local
        pending = _PendingFinish(
            tenant.id,
            request_id,
            completion_tokens,
            -1 if prompt_tokens is None else prompt_tokens,
            outcome,
            tenant.quotas.tokens_per_minute,
            orphan=False,
        )
        if self._should_try_redis():
            try:
                reply = await self._eval_finish(pending)
            except Exception as exc:
                if not _is_unavailable(exc):
                    raise
                self._mark_down("finish", exc)
            else:
                self._answered()
                return FinishResult(recorded=reply[0] == 1, refunded_tokens=int(reply[2]))
        self._buffer(pending)
        return FinishResult(recorded=True, deferred=True, backend=self.mode)

    async def _eval_finish(self, p: _PendingFinish) -> Any:
        args: list[Any] = [
            "finish",
            p.request_id,
            p.completion_tokens,
            p.prompt_tokens,
            p.outcome.value,
            _opt(p.tokens_per_minute),
            self._done_ttl_ms,
            self._retention_days,
            "1" if p.orphan else "0",
            _STATE_TTL_MS,
            self._settle_batch,
        ]
        return await self._eval(self._keys(p.tenant_id, p.request_id), args)

    async def _send_finish(self, p: _PendingFinish) -> bool:
        try:
            await self._eval_finish(p)
        except Exception as exc:
            if not _is_unavailable(exc):
                log.exception("replaying the finish of %s failed; dropping it", p.request_id)
                return True
            self._mark_down("finish", exc)
            return False
        return True

    def _buffer(self, p: _PendingFinish) -> None:
        if len(self._pending) >= self._pending_max:
            dropped = self._pending.popleft()
            self._local_ids.discard((dropped.tenant_id, dropped.request_id))
            metrics.DROPPED_FINISHES.inc()
            log.error("finish buffer full; dropped usage of request %s", dropped.request_id)
        self._pending.append(p)
        metrics.PENDING_FINISHES.set(len(self._pending))

    async def replay_pending(self) -> int:
        """Send buffered finishes to Redis, oldest first; stops at the first failure. Returns how many."""
        sent = 0
        while self._pending and self._healthy:
            p = self._pending[0]
            if not await self._send_finish(p):
                break
            self._pending.popleft()
            if p.orphan:
                self._local_ids.discard((p.tenant_id, p.request_id))
            sent += 1
        metrics.PENDING_FINISHES.set(len(self._pending))
        if sent:
            log.info("replayed %d buffered finishes into the quota store", sent)
        return sent
