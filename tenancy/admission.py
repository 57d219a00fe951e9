"""The admission interface the gateway calls, shared by the Redis and the in-process implementations.

Per request the gateway does::

    admission = await enforcer.admit(tenant, request_id, prompt_tokens, max_tokens)
    if not admission.granted:
        ...  # RESOURCE_EXHAUSTED, admission.limit, admission.retry_after_s
    async with enforcer.hold(tenant, admission) as lease:   # renews the lease in the background
        async for delta in stream:
            lease.completion_tokens += delta.num_tokens
    # leaving the block (normally, by error or by cancellation) calls finish(): lease released,
    # usage recorded, unused reserved tokens refunded, exactly once per request id.

Semantics (both implementations):

* requests/min and tokens/min are token buckets with one minute of capacity, refilled continuously;
  an admission takes 1 request and ``prompt_tokens + max_tokens`` tokens;
* concurrency is a lease that expires ``lease_ttl_s`` after admission or the last renewal; each
  renewal also reports the completion tokens delivered so far, stored with the lease;
* daily (UTC day) and monthly (UTC calendar month) token budgets count reservations immediately and
  are corrected to the actual usage at finish;
* a lease that lapses without a finish (its gateway died) is *settled* by whichever call notices the
  lapse first (an admission or renewal of the tenant, a finish, or the periodic ``sweep``): exactly as
  if ``finish`` had been called with the tokens of its last renewal and ``Outcome.EXPIRED``; once
  settled, a late ``finish`` or ``renew`` of that request changes nothing;
* all-or-nothing: a refusal changes nothing; it names the limit that needs the longest wait and that
  wait (``retry_after_s``; ``None`` when waiting can never help);
* idempotent by request id: a repeated ``admit`` of a running request returns its grant again
  (``duplicate=True``), a repeated ``finish`` is a no-op, and a lease is settled exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Protocol, runtime_checkable

from tenancy.errors import TenancyArgumentError
from tenancy.models import Quotas, Tenant

log = logging.getLogger(__name__)

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


class Limit(StrEnum):
    """Which limit refused an admission (the names match the ``Quotas`` fields)."""

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    CONCURRENCY = "max_concurrent"
    DAILY_BUDGET = "daily_token_budget"
    MONTHLY_BUDGET = "monthly_token_budget"
    QUOTA_STORE_UNAVAILABLE = "quota_store_unavailable"
    """Fail-closed mode while Redis does not answer."""
    DUPLICATE_REQUEST = "duplicate_request"
    """The request id was already used by a request that has finished."""


class Outcome(StrEnum):
    """How a request ended; cancelled and failed requests still pay for the tokens they produced."""

    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    EXPIRED = "expired"
    """The lease lapsed without a finish (the gateway died or stalled): settled by the quota store
    from the lease's last renewal. Metered as a request with usage field ``expired``."""


class QuotaMode(StrEnum):
    """Which backend decides admissions right now."""

    REDIS = "redis"
    FAIL_STATIC = "fail_static"
    FAIL_CLOSED = "fail_closed"
    LOCAL = "local"
    """The embedded single-node store's in-process limiter (by configuration, not by failure)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer to ``admit``: a granted lease or a refusal."""

    granted: bool
    tenant_id: str
    request_id: str
    backend: QuotaMode
    reserved_tokens: int = 0
    """Tokens taken from tokens/min and the budgets: prompt tokens + max_tokens."""
    prompt_tokens: int = 0
    lease_expires_at: float | None = None
    """Unix time (seconds) at which the concurrency lease lapses unless renewed."""
    limit: Limit | None = None
    retry_after_s: float | None = None
    """Seconds to wait before retrying; ``None`` on a grant, or when retrying can never succeed."""
    duplicate: bool = False

    @property
    def retryable(self) -> bool:
        return not self.granted and self.retry_after_s is not None


@dataclass(frozen=True, slots=True)
class Renewal:
    renewed: bool
    lease_expires_at: float | None = None
    reason: str = ""
    """On failure: ``unknown`` (no such running request), ``finished``, ``lost`` (the lease lapsed and
    has been settled from its last renewal: the request is over as far as quotas go; a later finish
    is a no-op), or ``unavailable`` (the quota store did not answer). ``reacquired`` on success after
    a lapse that nobody had settled yet, while a slot was free."""


@dataclass(frozen=True, slots=True)
class FinishResult:
    recorded: bool
    """False when this request id had already finished (the call was a no-op)."""
    refunded_tokens: int = 0
    """Reserved tokens given back (negative: extra tokens charged beyond the reservation)."""
    deferred: bool = False
    """Redis was unreachable: the finish is buffered and replayed when it answers again."""
    backend: QuotaMode = QuotaMode.REDIS


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """The numbers an enforcer applies: a tenant's quotas, or its share of them in fail-static mode."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    daily_token_budget: int | None
    monthly_token_budget: int | None

    @classmethod
    def of(cls, quotas: Quotas) -> EffectiveLimits:
        return cls(
            quotas.requests_per_minute,
            quotas.tokens_per_minute,
            quotas.max_concurrent,
            quotas.daily_token_budget,
            quotas.monthly_token_budget,
        )

    def share(self, replicas: int, *, day_used: int = 0, month_used: int = 0) -> EffectiveLimits:
        """This replica's share when each of ``replicas`` enforces limits on its own.

        Rates and concurrency are divided (floored, at least 1). Budgets: what was left at the last
        Redis answer, divided, so that the replicas together cannot overspend the remainder.
        """

        def part(value: int | None) -> int | None:
            return None if value is None else max(1, value // replicas)

        def left(budget: int | None, used: int) -> int | None:
            return None if budget is None else max(0, budget - used) // replicas

        return EffectiveLimits(
            part(self.requests_per_minute),
            part(self.tokens_per_minute),
            part(self.max_concurrent),
            left(self.daily_token_budget, day_used),
            left(self.monthly_token_budget, month_used),
        )


def validate_admission_args(request_id: str, prompt_tokens: int, max_tokens: int) -> None:
    validate_request_id(request_id)
    if not isinstance(prompt_tokens, int) or prompt_tokens < 0:
        raise TenancyArgumentError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise TenancyArgumentError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")


def validate_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not _REQUEST_ID_RE.match(request_id):
        raise TenancyArgumentError(
            "request_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'"
        )


def validate_renew(request_id: str, completion_tokens: int | None) -> None:
    validate_request_id(request_id)
    if completion_tokens is not None and (not isinstance(completion_tokens, int) or completion_tokens < 0):
        raise TenancyArgumentError(f"completion_tokens must be an integer >= 0, got {completion_tokens!r}")


def validate_finish(request_id: str, completion_tokens: int, prompt_tokens: int | None) -> None:
    """The argument checks every ``finish`` implementation makes before touching any state."""
    validate_request_id(request_id)
    if completion_tokens < 0 or (prompt_tokens is not None and prompt_tokens < 0):
        raise TenancyArgumentError("token counts must be >= 0")


@runtime_checkable
class QuotaEnforcer(Protocol):
    """What the gateway needs from admission; implemented by ``RedisAdmission`` and ``LocalAdmission``."""

    @property
    def mode(self) -> QuotaMode: ...

    @property
    def lease_ttl_s(self) -> float: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def admit(
        self, tenant: Tenant, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Admission: ...

    async def renew(self, tenant: Tenant, request_id: str, completion_tokens: int | None = None) -> Renewal:
        """Extend the lease; ``completion_tokens`` (tokens delivered so far) is stored with it, and is
        what the request is charged if the lease lapses before ``finish`` (``None``: keep the last)."""
        ...

    async def finish(
        self,
        tenant: Tenant,
        request_id: str,
        completion_tokens: int,
        *,
        prompt_tokens: int | None = None,
        outcome: Outcome = Outcome.OK,
    ) -> FinishResult: ...

    def hold(self, tenant: Tenant, admission: Admission) -> ActiveLease: ...

    async def sweep(self, tenants: Iterable[Tenant] = ()) -> int:
        """Settle lapsed leases (bounded work per call); returns how many were settled.

        Admissions settle the lapsed leases of their own tenant; the runtime calls this periodically
        so that a tenant with no traffic gets its lapsed leases settled too."""
        ...


class ActiveLease:
    """Keeps a granted admission's lease alive while a stream runs, and finishes it exactly once.

    Use as ``async with``: the lease is renewed every ``lease_ttl_s / 3`` in a background task, each
    renewal reporting the current ``completion_tokens`` (so that if this process dies, the request is
    settled with what it had delivered by its last renewal); leaving
    the block finishes the request with the tokens counted in ``completion_tokens``, as ``ok``, or
    ``cancelled`` (task cancelled) or ``error`` (any other exception). The finish is shielded from a
    second cancellation so that a client disconnect can never leak the slot or lose the usage.
    """

    def __init__(
        self,
        enforcer: QuotaEnforcer,
        tenant: Tenant,
        admission: Admission,
        *,
        renew_interval_s: float | None = None,
    ) -> None:
        if not admission.granted:
            raise TenancyArgumentError("cannot hold a refused admission")
        self._enforcer = enforcer
        self._tenant = tenant
        self.admission = admission
        self.completion_tokens = 0
        self.prompt_tokens: int = admission.prompt_tokens
        self.lost = False
        self._interval = renew_interval_s or max(0.05, enforcer.lease_ttl_s / 3)
        self._task: asyncio.Task[None] | None = None
        self._result: FinishResult | None = None
        self._finishing: asyncio.Future[FinishResult] | None = None

    @property
    def request_id(self) -> str:
        return self.admission.request_id

    @property
    def finished(self) -> bool:
        return self._result is not None

    async def __aenter__(self) -> ActiveLease:
        self.start_renewing()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            outcome = Outcome.OK
        elif issubclass(exc_type, asyncio.CancelledError | GeneratorExit):
            outcome = Outcome.CANCELLED
        else:
            outcome = Outcome.ERROR
        await self.finish(outcome)

    def start_renewing(self) -> None:
        if self._task is None and self._result is None:
            self._task = asyncio.get_running_loop().create_task(
                self._renew_loop(), name=f"lease-renew:{self.request_id}"
            )

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                renewal = await self._enforcer.renew(
                    self._tenant, self.request_id, completion_tokens=self.completion_tokens
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # a renewal failure must never kill the stream it protects
                log.exception("lease renewal of %s failed", self.request_id)
                continue
            if renewal.renewed or self.lost:
                continue
            if renewal.reason == "unavailable":
                # The quota store is down: the lease lapses there, and is taken again on the first
                # renewal after it comes back if a slot is free. Nothing to do but keep trying.
                log.debug("lease of %s not renewed: quota store unavailable", self.request_id)
            else:
                self.lost = True
                log.warning(
                    "lease of request %s (tenant %s) could not be renewed: %s",
                    self.request_id,
                    self._tenant.id,
                    renewal.reason,
                )

    async def finish(self, outcome: Outcome = Outcome.OK) -> FinishResult:
        """Stop renewing, release the lease, record usage. Safe to call more than once."""
        if self._result is not None:
            return self._result
        if self._finishing is None:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
            self._finishing = asyncio.ensure_future(
                self._enforcer.finish(
                    self._tenant,
                    self.request_id,
                    self.completion_tokens,
                    prompt_tokens=self.prompt_tokens,
                    outcome=outcome,
                )
            )
        # shield: if our caller is cancelled again, the finish still runs to completion.
        self._result = await asyncio.shield(self._finishing)
        return self._result


def describe(admission: Admission) -> Mapping[str, object]:
    """A log/metadata-friendly view of an admission (no secrets in it)."""
    return {
        "granted": admission.granted,
        "tenant": admission.tenant_id,
        "request_id": admission.request_id,
        "limit": admission.limit.value if admission.limit else None,
        "retry_after_s": admission.retry_after_s,
        "backend": admission.backend.value,
    }
