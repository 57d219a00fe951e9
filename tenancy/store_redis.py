"""The Redis tenant store: source of truth for clusters (admin side, synchronous).

Every change is one atomic script (``lua/config.lua``) that bumps the global config revision, stores
the change, appends an audit entry (who, when, what) to a capped stream and publishes
``{"tenant", "version", "op"}`` on the changes channel. Gateways apply the announcement to their cache
(``watch_redis.RedisTenantWatcher``) and also resync periodically, so a lost message heals itself.

Only keyed hashes of API keys are written; the plaintext exists once, in the returned ``IssuedKey``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any

import redis

from tenancy import quota_math as qm
from tenancy.directory import TenantEntry
from tenancy.errors import (
    ConcurrentModificationError,
    KeyNotFoundError,
    StoreUnavailableError,
    TenantExistsError,
    TenantNotFoundError,
)
from tenancy.keys import KeyHasher
from tenancy.models import (
    ApiKey,
    AuditEntry,
    DailyUsage,
    IssuedKey,
    Tenant,
    parse_tenant,
    utcnow,
    validate_tenant_id,
)
from tenancy.redis_client import sync_client
from tenancy.redis_layout import RedisLayout
from tenancy.settings import TenancySettings
from tenancy.store import SharedAdminCommands, apply_changes, diff, key_summary, new_tenant

CONFIG_LUA = resources.files("tenancy").joinpath("lua/config.lua").read_text(encoding="utf-8")
_UPDATE_ATTEMPTS = 8
USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cancelled", "errors", "expired")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_entry(raw_tenant: bytes | str, version: int, raw_keys: Mapping[Any, Any]) -> TenantEntry:
    """Build a cache entry from the stored JSON of a tenant and of its keys."""
    tenant = parse_tenant(json.loads(raw_tenant), version=version)
    keys = tuple(ApiKey.model_validate_json(v) for v in raw_keys.values())
    return TenantEntry(tenant=tenant, keys=keys)


def parse_usage(tenant_id: str, raw: Mapping[Any, Any], days: list[str]) -> list[DailyUsage]:
    """Daily rows for ``days`` (ISO dates) from a usage hash of ``YYYY-MM-DD|field -> n``."""
    counts: dict[str, dict[str, int]] = {d: {} for d in days}
    for k, v in raw.items():
        label, _, field = _text(k).partition("|")
        if label in counts and field in USAGE_FIELDS:
            counts[label][field] = int(v)
    return [DailyUsage(tenant_id=tenant_id, day=d, **counts[d]) for d in days]


class RedisTenantStore(SharedAdminCommands):
    """Admin operations on the Redis tenant store (see :class:`tenancy.store.TenantAdmin`)."""

    def __init__(
        self,
        client: redis.Redis,
        hasher: KeyHasher,
        *,
        layout: RedisLayout | None = None,
        audit_max_entries: int = 100_000,
    ) -> None:
        self._client = client
        self._hasher = hasher
        self._layout = layout or RedisLayout()
        self._audit_max = audit_max_entries
        self._script = client.register_script(CONFIG_LUA)

    @classmethod
    def from_settings(cls, settings: TenancySettings, hasher: KeyHasher | None = None) -> RedisTenantStore:
        client = sync_client(settings.redis_dsn, timeout_s=max(settings.redis_timeout_s, 2.0))
        return cls(
            client,
            hasher or settings.hasher(),
            layout=RedisLayout(settings.key_prefix),
            audit_max_entries=settings.audit_max_entries,
        )

    @property
    def layout(self) -> RedisLayout:
        return self._layout

    def close(self) -> None:
        self._client.close()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailableError(f"tenant store (Redis) unavailable: {exc}") from exc

    def _write(
        self,
        op: str,
        tenant_id: str,
        expect: str,
        arg4: str = "",
        arg5: str = "",
        *,
        actor: str,
        action: str,
        changes: Mapping[str, Any],
        key_id: str = "",
    ) -> tuple[bool, str, int]:
        lay = self._layout
        keys = [
            lay.config_version,
            lay.tenant_versions,
            lay.tenant(tenant_id),
            lay.tenant_keys(tenant_id),
            lay.key_index,
            lay.audit,
        ]
        args: list[Any] = [
            op,
            tenant_id,
            expect,
            arg4,
            arg5,
            actor,
            action,
            json.dumps(changes, default=str, sort_keys=True),
            self._audit_max,
            lay.changes_channel,
            key_id,
        ]
        with self._guard():
            ok, status, version = self._script(keys=keys, args=args)
        return ok == 1, _text(status), int(version)

    # -- tenants ----------------------------------------------------------------------------------
    def create_tenant(self, tenant: Tenant, *, actor: str) -> Tenant:
        tenant = new_tenant(tenant)
        ok, _status, version = self._write(
            "put_tenant",
            tenant.id,
            "absent",
            json.dumps(tenant.config_dict()),
            actor=actor,
            action="tenant.create",
            changes=diff(None, tenant),
        )
        if not ok:
            raise TenantExistsError(tenant.id)
        return tenant.model_copy(update={"version": version})

    def get_tenant(self, tenant_id: str) -> Tenant:
        validate_tenant_id(tenant_id)
        with self._guard():
            pipe = self._client.pipeline(transaction=True)
            pipe.get(self._layout.tenant(tenant_id))
            pipe.hget(self._layout.tenant_versions, tenant_id)
            raw, version = pipe.execute()
        if raw is None:
            raise TenantNotFoundError(tenant_id)
        return parse_tenant(json.loads(raw), version=int(version or 0))

    def list_tenants(self) -> list[Tenant]:
        return sorted((e.tenant for e in self.load_entries()), key=lambda t: t.id)

    def _update(self, tenant_id: str, changes: Mapping[str, Any], *, actor: str, action: str) -> Tenant:
        for _ in range(_UPDATE_ATTEMPTS):
            current = self.get_tenant(tenant_id)
            updated = apply_changes(current, changes)
            ok, status, version = self._write(
                "put_tenant",
                tenant_id,
                str(current.version),
                json.dumps(updated.config_dict()),
                actor=actor,
                action=action,
                changes=diff(current, updated),
            )
            if ok:
                return updated.model_copy(update={"version": version})
            if status == "missing":
                raise TenantNotFoundError(tenant_id)
        raise ConcurrentModificationError(f"tenant {tenant_id!r} kept changing; try again")

    def delete_tenant(self, tenant_id: str, *, actor: str) -> None:
        current = self.get_tenant(tenant_id)
        ok, _status, _ = self._write(
            "delete_tenant",
            tenant_id,
            "present",
            actor=actor,
            action="tenant.delete",
            changes=diff(current, None),
        )
        if not ok:
            raise TenantNotFoundError(tenant_id)
        # Quota state lives in the tenant's own slot, so it goes in a second call. Usage is kept.
        with self._guard():
            self._client.delete(*self._layout.tenant_quota_keys(tenant_id))

    # -- keys ---------------------------------------------------------------------------------------
    def create_key(
        self, tenant_id: str, *, actor: str, name: str = "", expires_at: datetime | None = None
    ) -> IssuedKey:
        issued = self._hasher.issue(tenant_id, name=name, created_by=actor, expires_at=expires_at)
        self._put_key(issued.record, actor=actor, action="key.create", changes=key_summary(issued.record))
        return issued

    def _put_key(self, key: ApiKey, *, actor: str, action: str, changes: Mapping[str, Any]) -> None:
        ok, _, _ = self._write(
            "put_key",
            key.tenant_id,
            "present",
            key.key_id,
            key.model_dump_json(),
            actor=actor,
            action=action,
            changes=changes,
            key_id=key.key_id,
        )
        if not ok:
            raise TenantNotFoundError(key.tenant_id)

    def get_key(self, key_id: str) -> ApiKey:
        with self._guard():
            tenant_id = self._client.hget(self._layout.key_index, key_id)
            raw = self._client.hget(self._layout.tenant_keys(_text(tenant_id)), key_id) if tenant_id else None
        if raw is None:
            raise KeyNotFoundError(key_id)
        return ApiKey.model_validate_json(raw)

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        self.get_tenant(tenant_id)
        with self._guard():
            raw = self._client.hgetall(self._layout.tenant_keys(tenant_id))
        return sorted((ApiKey.model_validate_json(v) for v in raw.values()), key=lambda k: k.created_at)

    def revoke_key(self, key_id: str, *, actor: str, grace_s: float = 0.0) -> ApiKey:
        key = self.get_key(key_id)
        at = utcnow() + timedelta(seconds=max(0.0, grace_s))
        if key.revoked_at is not None and key.revoked_at <= at:
            return key  # already revoked (at least as early): nothing to change
        revoked = key.model_copy(update={"revoked_at": at})
        self._put_key(
            revoked,
            actor=actor,
            action="key.revoke",
            changes={"revoked_at": [_iso(key.revoked_at), _iso(at)]},
        )
        return revoked

    # -- reads for caches and tools ----------------------------------------------------------------
    def config_version(self) -> int:
        with self._guard():
            return int(self._client.get(self._layout.config_version) or 0)

    def load_entries(self) -> list[TenantEntry]:
        """Every tenant with its keys (what a gateway cache holds)."""
        with self._guard():
            versions = self._client.hgetall(self._layout.tenant_versions)
            ids = sorted(_text(t) for t in versions)
            pipe = self._client.pipeline(transaction=False)
            for tid in ids:
                pipe.get(self._layout.tenant(tid))
                pipe.hgetall(self._layout.tenant_keys(tid))
            results = pipe.execute()
        entries = []
        for i, tid in enumerate(ids):
            raw, keys = results[2 * i], results[2 * i + 1]
            if raw is not None:
                entries.append(decode_entry(raw, int(versions[tid.encode()]), keys))
        return entries

    def usage(self, tenant_id: str, days: int = 30) -> list[DailyUsage]:
        """Metered usage of the last ``days`` UTC days by Redis server time (oldest first)."""
        validate_tenant_id(tenant_id)
        with self._guard():
            seconds, _ = self._client.time()
            raw = self._client.hgetall(self._layout.usage(tenant_id))
        today = datetime.fromtimestamp(seconds, tz=UTC).date()
        labels = [d.isoformat() for d in qm.days_back(today, days)]
        return parse_usage(tenant_id, raw, labels)

    def quota_status(self, tenant_id: str) -> dict[str, int]:
        """Live quota state: active leases and budget tokens used (incl. reservations) today/this month."""
        validate_tenant_id(tenant_id)
        lay = self._layout
        with self._guard():
            seconds, micros = self._client.time()
            now_us = seconds * 1_000_000 + micros
            pipe = self._client.pipeline(transaction=False)
            pipe.zcount(lay.leases(tenant_id), f"({now_us}", "+inf")
            pipe.hmget(lay.quota_state(tenant_id), ["day", "day_used", "month", "month_used"])
            leases, (day, day_used, month, month_used) = pipe.execute()
        today = qm.day_index(now_us)
        return {
            "active_leases": int(leases),
            "day_tokens_used": int(day_used) if day is not None and int(day) == today else 0,
            "month_tokens_used": int(month_used)
            if month is not None and int(month) == qm.month_index(today)
            else 0,
        }

    def audit_log(self, count: int = 50) -> list[AuditEntry]:
        """The most recent admin changes, newest first."""
        with self._guard():
            rows = self._client.xrevrange(self._layout.audit, count=count) or []
        entries = []
        for entry_id, fields in rows:
            f = {_text(k): _text(v) for k, v in (fields or {}).items()}
            ms = int(_text(entry_id).split("-")[0])
            entries.append(
                AuditEntry(
                    id=_text(entry_id),
                    at=datetime.fromtimestamp(ms / 1000, tz=UTC),
                    actor=f.get("actor", ""),
                    action=f.get("action", ""),
                    tenant_id=f.get("tenant", ""),
                    key_id=f.get("key_id") or None,
                    version=int(f["version"]) if f.get("version") else None,
                    changes=json.loads(f.get("changes") or "{}"),
                )
            )
        return entries


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
