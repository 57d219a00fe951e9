"""Tenancy settings, read from ``LOOM_TENANCY_*`` environment variables (or passed explicitly)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tenancy.keys import KeyHasher, load_or_create_secret


class FailureMode(StrEnum):
    """What admission does while Redis does not answer."""

    FAIL_STATIC = "fail_static"
    """Keep serving from cached tenants; enforce limits locally, each replica taking 1/N of them."""
    FAIL_CLOSED = "fail_closed"
    """Refuse every admission (``limit = quota_store_unavailable``) until Redis answers again."""


class TenancySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_TENANCY_", extra="ignore", frozen=True)

    store: Literal["file", "redis"] = Field(
        default="file", description="'file': embedded single-node store; 'redis': the cluster store."
    )
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: SecretStr | None = Field(
        default=None,
        description="Redis's password, when not in redis_url: kept apart so that the URL can be shared "
        "config and the password given only to the pods that talk to Redis (the gateways)",
    )
    key_prefix: str = Field(
        default="loom", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Prefix of every Redis key."
    )
    tenants_file: Path = Path(".loom/tenants.yaml")
    secret: SecretStr | None = Field(
        default=None, description="Server secret for API-key HMACs; else read/created at secret_file."
    )
    previous_secrets: list[SecretStr] = Field(
        default_factory=list, description="Older server secrets still accepted while rotating."
    )
    secret_file: Path = Path(".loom/secret")

    failure_mode: FailureMode = FailureMode.FAIL_STATIC
    gateway_replicas: int = Field(
        default=1, ge=1, description="Replica count: in fail-static each replica enforces 1/N of a limit."
    )
    redis_timeout_s: float = Field(default=1.0, gt=0, le=10, description="Per-command socket timeout.")
    redis_timeouts_to_degrade: int = Field(
        default=3,
        ge=1,
        description="Timeouts in a row before admission degrades to failure_mode (a refused connection "
        "degrades at once); a timeout before that refuses its own request as retryable.",
    )
    redis_max_connections: int = Field(
        default=128,
        ge=1,
        description="Admission's Redis connections per gateway process, all opened at start, so a "
        "burst of requests does not open them in its requests' path.",
    )
    redis_probe_interval_s: float = Field(
        default=1.0, gt=0, description="While Redis is down, how often to try it again."
    )
    resync_interval_s: float = Field(
        default=30.0, gt=0, description="Full config check against Redis (heals missed pub/sub)."
    )
    file_poll_interval_s: float = Field(default=1.0, gt=0)

    lease_ttl_s: float = Field(
        default=30.0, gt=0, description="Concurrency lease lifetime; renewed while a stream runs."
    )
    record_grace_s: float = Field(
        default=300.0,
        ge=0,
        description="In-process limiter: a running request unrenewed for lease_ttl_s + this is settled "
        "by the record scan even if no lease check noticed it (a backstop). Redis keeps running "
        "records until their lapsed lease is settled.",
    )
    lease_sweep_interval_s: float = Field(
        default=2.0, gt=0, description="How often the runtime settles lapsed leases of idle tenants."
    )
    lease_sweep_tenants: int = Field(
        default=100, ge=1, description="Redis: tenants visited per sweep (round robin, one round trip)."
    )
    lease_settle_batch: int = Field(
        default=32, ge=1, description="Redis: lapsed leases one script call settles at most."
    )
    state_flush_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="Embedded store: how often budgets and usage are written to the state file "
        "(if they changed; also at stop).",
    )
    finished_ttl_s: float = Field(
        default=3600.0, gt=0, description="Idempotency window: a repeated finish within it is a no-op."
    )
    concurrency_retry_hint_s: float = Field(
        default=1.0, gt=0, description="Retry delay suggested when refused on concurrency."
    )
    usage_retention_days: int = Field(default=400, ge=2)
    audit_max_entries: int = Field(default=100_000, ge=100)
    pending_finish_max: int = Field(
        default=100_000, ge=1, description="Finishes buffered while Redis is down, replayed after."
    )

    @property
    def redis_dsn(self) -> str:
        """The URL clients connect with: ``redis_url``, with ``redis_password`` put in if it is set."""
        if self.redis_password is None:
            return self.redis_url
        parts = urlsplit(self.redis_url)
        user = parts.username or ""
        password = quote(self.redis_password.get_secret_value(), safe="")
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}{port}"))

    def hasher(self) -> KeyHasher:
        """The key hasher for these settings (reads or creates the secret file if no secret is set)."""
        secret = (
            self.secret.get_secret_value().encode()
            if self.secret is not None
            else load_or_create_secret(self.secret_file)
        )
        previous = [s.get_secret_value().encode() for s in self.previous_secrets]
        return KeyHasher(secret, previous)
