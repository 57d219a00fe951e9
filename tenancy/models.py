"""The tenant and API-key data model: what an admin configures and what the gateway reads.

Everything here is an immutable pydantic model so that a cached snapshot can be shared between
coroutines without copies, and so that a bad definition is refused with a message naming every
problem before it reaches a store.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from common import Priority
from tenancy.errors import TenantValidationError

TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
"""Lowercase, digits, ``_`` and ``-``; at most 63 characters. No ``{``, ``}`` or ``:``, so a tenant id can
sit inside a Redis hash tag and a key name without escaping."""

_TENANT_ID_RE = re.compile(TENANT_ID_PATTERN)
POOL_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
SHARED_POOL = "shared"

TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN, description="Stable tenant identifier")]


def utcnow() -> datetime:
    return datetime.now(UTC)


def validate_tenant_id(tenant_id: str) -> str:
    """Raise :class:`TenantValidationError` unless ``tenant_id`` is a well-formed tenant id."""
    if not isinstance(tenant_id, str) or not _TENANT_ID_RE.match(tenant_id):
        raise TenantValidationError(
            f"invalid tenant id {tenant_id!r}: use 1-63 characters of a-z, 0-9, '_' or '-', "
            "starting with a letter or digit"
        )
    return tenant_id


class TenantStatus(StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class Quotas(_Frozen):
    """Per-tenant limits. ``None`` means unlimited; to block a tenant, suspend it instead of using 0.

    Rate limits are token buckets whose capacity is one minute's worth: a tenant may burst up to its
    per-minute limit at once, then is refilled continuously at limit/60 per second.
    """

    requests_per_minute: int | None = Field(default=60, ge=1)
    tokens_per_minute: int | None = Field(
        default=100_000, ge=1, description="Reserved at admission as prompt tokens + max_tokens."
    )
    max_concurrent: int | None = Field(default=8, ge=1, description="Concurrent streams (leases).")
    max_tokens_per_request: int | None = Field(default=4096, ge=1, description="Cap on max_tokens.")
    max_prompt_tokens: int | None = Field(default=8192, ge=1)
    daily_token_budget: int | None = Field(default=None, ge=1, description="Per UTC day.")
    monthly_token_budget: int | None = Field(default=None, ge=1, description="Per UTC calendar month.")

    @classmethod
    def unlimited(cls) -> Quotas:
        """No limit at all (tests, benchmarks, trusted internal tenants)."""
        return cls(**dict.fromkeys(cls.model_fields))

    @model_validator(mode="after")
    def _coherent(self) -> Quotas:
        problems: list[str] = []
        per_request = (
            self.max_prompt_tokens + self.max_tokens_per_request
            if self.max_prompt_tokens is not None and self.max_tokens_per_request is not None
            else None
        )
        if per_request is not None:
            for name in ("tokens_per_minute", "daily_token_budget", "monthly_token_budget"):
                value = getattr(self, name)
                if value is not None and value < per_request:
                    problems.append(
                        f"{name} ({value}) is below max_prompt_tokens + max_tokens_per_request "
                        f"({per_request}), so a request within the per-request limits could never be "
                        "admitted; raise it or lower the per-request limits"
                    )
        if (
            self.daily_token_budget is not None
            and self.monthly_token_budget is not None
            and self.daily_token_budget > self.monthly_token_budget
        ):
            problems.append(
                f"daily_token_budget ({self.daily_token_budget}) is above monthly_token_budget "
                f"({self.monthly_token_budget})"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


ADAPTER_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
"""An adapter's name, requested as ``<base model>:<name>``; no ``:`` so the split is unambiguous."""


class SloTarget(_Frozen):
    """What a tenant is promised for its requests of one priority class (admins set it, like quotas).

    The gateway predicts a request's time to first token from the replicas' published load before it
    admits it; past ``ttft_ms`` it refuses the request at once with the prediction and the target
    (``on_miss="refuse"``: the client can retry, or send it as a lower class), or admits it to wait
    (``"queue"``). Every request of the class is counted against both targets when it ends (goodput).
    """

    ttft_ms: float | None = Field(default=None, gt=0, le=3_600_000, description="time to first token")
    tpot_ms: float | None = Field(default=None, gt=0, le=60_000, description="time per output token")
    on_miss: Literal["refuse", "queue"] = "refuse"

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a request that ended with these latencies met the targets (no token: it did not)."""
        if ttft_s is None:
            return False
        if self.ttft_ms is not None and ttft_s * 1000 > self.ttft_ms:
            return False
        return not (self.tpot_ms is not None and tpot_s is not None and tpot_s * 1000 > self.tpot_ms)


class AdapterRecord(_Frozen):
    """A tenant's LoRA adapter, as an admin registered it (``loom admin adapter add``).

    Registration checked the files against the base model; replicas read them from ``path`` (local
    disk or a shared volume) when a request first needs them. ``digest`` makes a changed file a new
    adapter: caches and replicas never mix two versions under one name.
    """

    base_model: str = Field(description="the served model it adapts, as clients name that model")
    path: str
    digest: str = Field(pattern=r"^[0-9a-f]{16}$")
    rank: int = Field(ge=1, le=64)
    targets: tuple[str, ...]
    added_at: datetime | None = None

    def engine_id(self, tenant_id: str, name: str) -> str:
        """The adapter's identity inside engines: unique across tenants, names and versions."""
        return f"{tenant_id}/{name}@{self.digest}"


class Tenant(_Frozen):
    """One customer of the service, as configured by a platform admin."""

    id: TenantId
    display_name: str = Field(default="", max_length=200)
    status: TenantStatus = TenantStatus.ACTIVE
    priority_ceiling: Priority = Field(
        default=Priority.STANDARD, description="Highest priority a request of this tenant may get."
    )
    default_priority: Priority = Field(
        default=Priority.STANDARD, description="Priority of a request that gives no hint."
    )
    weight: float = Field(
        default=1.0, gt=0, le=10_000, description="Fair-share weight inside a priority class."
    )
    kv_floor: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Share of each replica's KV blocks the tenant keeps whatever others do (its cached "
        "prefixes included): others neither evict nor preempt it below this.",
    )
    kv_cap: float = Field(
        default=1.0, gt=0, le=1, description="Most of each replica's KV blocks the tenant may hold."
    )
    speculative: bool = Field(
        default=False,
        description="Requests speculate by default (prompt lookup: input-grounded work runs faster, "
        "output unchanged); a request's own 'speculative' overrides it.",
    )
    quotas: Quotas = Field(default_factory=Quotas)
    slo: dict[Priority, SloTarget] = Field(
        default_factory=dict, description="Latency targets per priority class (none: best effort)."
    )
    allowed_models: tuple[str, ...] = Field(
        default=("*",), description="Model names or shell-style patterns; '*' allows every model."
    )
    pool: Literal["shared", "dedicated"] = "shared"
    dedicated_pool: str | None = Field(default=None, pattern=POOL_NAME_PATTERN)
    adapters: dict[Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)], AdapterRecord] = Field(
        default_factory=dict, description="LoRA adapters of this tenant, by name (only it may use them)"
    )
    created_at: datetime | None = None
    updated_at: datetime | None = None
    version: int = Field(
        default=0, ge=0, description="Store revision of this tenant; set by the store, never by hand."
    )

    @field_validator("allowed_models")
    @classmethod
    def _models_non_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        cleaned = tuple(m.strip() for m in value)
        if any(not m for m in cleaned):
            raise ValueError("allowed_models entries must be non-empty model names or patterns")
        return cleaned

    @model_validator(mode="after")
    def _coherent(self) -> Tenant:
        problems: list[str] = []
        if self.default_priority < self.priority_ceiling:
            problems.append(
                f"default_priority ({self.default_priority}) is above priority_ceiling "
                f"({self.priority_ceiling})"
            )
        if self.kv_floor > self.kv_cap:
            problems.append(f"kv_floor ({self.kv_floor}) is above kv_cap ({self.kv_cap})")
        if self.pool == "dedicated" and not self.dedicated_pool:
            problems.append("pool 'dedicated' needs dedicated_pool (the name of the tenant's own pool)")
        if self.pool == "shared" and self.dedicated_pool:
            problems.append("dedicated_pool is set but pool is 'shared'; set pool to 'dedicated'")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def is_active(self) -> bool:
        return self.status is TenantStatus.ACTIVE

    @property
    def is_dedicated(self) -> bool:
        return self.pool == "dedicated"

    @property
    def pool_name(self) -> str:
        """``"shared"`` or the name of the tenant's dedicated pool: where the gateway dispatches."""
        return self.dedicated_pool if self.is_dedicated and self.dedicated_pool else SHARED_POOL

    def allows_model(self, model: str) -> bool:
        """Whether this tenant may call ``model``; an adapter ``<base>:<name>`` is judged by its base."""
        base = model.split(":", 1)[0]
        return any(fnmatch.fnmatchcase(base, pattern) for pattern in self.allowed_models)

    def adapter(self, model: str) -> tuple[str, AdapterRecord] | None:
        """``(name, record)`` when ``model`` is ``<base>:<name>`` of one of this tenant's adapters."""
        base, sep, name = model.partition(":")
        record = self.adapters.get(name) if sep else None
        return (name, record) if record is not None and record.base_model == base else None

    def effective_priority(self, hint: Priority | str | None = None) -> Priority:
        """The request's priority hint (or this tenant's default) capped at this tenant's ceiling.

        An unknown hint string falls back to the default instead of failing the request: a priority
        hint is advice, and the ceiling is what protects other tenants.
        """
        if hint is None or hint == "":
            chosen = self.default_priority
        else:
            try:
                chosen = Priority(hint)
            except ValueError:
                chosen = self.default_priority
        return chosen.capped_at(self.priority_ceiling)

    def config_dict(self) -> dict[str, Any]:
        """The admin-controlled fields, as stored (``version`` belongs to the store, not the record)."""
        return self.model_dump(mode="json", exclude={"version"})


def parse_tenant(data: Any, *, version: int | None = None) -> Tenant:
    """Validate ``data`` into a :class:`Tenant`, with one readable message for every problem found."""
    if version is not None and isinstance(data, dict):
        data = {**data, "version": version}
    try:
        tenant = Tenant.model_validate(data)
    except ValidationError as exc:
        raise TenantValidationError(describe_validation_error(exc, "tenant")) from None
    return tenant


def describe_validation_error(exc: ValidationError, what: str) -> str:
    """Turn a pydantic error into ``invalid tenant: quotas.tokens_per_minute: ...; id: ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        location = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        message = err.get("msg", "invalid")
        message = message.removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return f"invalid {what}: " + "; ".join(parts)


class ApiKey(_Frozen):
    """The stored form of an API key: never the key itself, only its keyed hash (HMAC-SHA256).

    ``revoked_at`` may lie in the future: that is a rotation overlap, the key keeps working until then.
    """

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    tenant_id: TenantId
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex HMAC-SHA256 of the full key")
    secret_id: str = Field(description="Fingerprint of the server secret the digest was made with.")
    name: str = Field(default="", max_length=200)
    created_at: datetime
    created_by: str = ""
    expires_at: datetime | None = None
    revoked_at: datetime | None = None

    def is_valid_at(self, now: datetime) -> bool:
        if self.expires_at is not None and now >= self.expires_at:
            return False
        return not (self.revoked_at is not None and now >= self.revoked_at)

    def state_at(self, now: datetime) -> str:
        """``active``, ``revoked``, ``expired`` or ``revoking`` (revocation scheduled: rotation overlap)."""
        if self.revoked_at is not None and now >= self.revoked_at:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        if self.revoked_at is not None:
            return "revoking"
        return "active"


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly created key: the plaintext exists only here, once, to be shown to the admin.

    ``repr`` hides it so that logging the object never leaks it; read ``plaintext.get_secret_value()``.
    """

    record: ApiKey
    plaintext: SecretStr

    @property
    def key_id(self) -> str:
        return self.record.key_id

    def __repr__(self) -> str:
        return f"IssuedKey(key_id={self.record.key_id!r}, tenant_id={self.record.tenant_id!r})"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from: the tenant (a snapshot of its config) and the key that authenticated."""

    tenant: Tenant
    key_id: str

    @property
    def tenant_id(self) -> str:
        return self.tenant.id


class DailyUsage(_Frozen):
    """Metered usage of one tenant on one UTC day (recorded when requests end)."""

    tenant_id: str
    day: date
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    errors: int = 0
    expired: int = 0
    """Requests whose lease lapsed without a finish (gateway gone), settled from their last renewal."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class AuditEntry(_Frozen):
    """One admin change: who, when, what (``changes`` maps a field to ``[old, new]``)."""

    id: str
    at: datetime
    actor: str
    action: str
    tenant_id: str
    key_id: str | None = None
    version: int | None = None
    changes: dict[str, Any] = Field(default_factory=dict)
