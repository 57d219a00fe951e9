"""The gateway's in-memory copy of all tenants and API keys, and authentication against it.

Every gateway replica keeps the whole catalog in memory (tenants and key records are small: thousands
of tenants are a few megabytes). Authentication is therefore a dict lookup plus one HMAC, with no
Redis round trip on the hot path. Watchers (Redis pub/sub + resync, or the file poller) keep it fresh.

The catalog is replaced copy-on-write: readers grab the current immutable snapshot and are never
blocked by, or torn by, an update running in the same event loop or another thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType

from tenancy import metrics
from tenancy.errors import AuthenticationError
from tenancy.keys import KeyHasher, parse_key_id, strip_bearer
from tenancy.models import ApiKey, Principal, Tenant, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One tenant with its keys, at one revision."""

    tenant: Tenant
    keys: tuple[ApiKey, ...] = ()

    @property
    def version(self) -> int:
        return self.tenant.version


@dataclass(frozen=True, slots=True)
class TenantCatalog:
    """An immutable snapshot: tenants by id and key records by key id."""

    tenants: Mapping[str, TenantEntry] = field(default_factory=dict)
    keys: Mapping[str, ApiKey] = field(default_factory=dict)

    @classmethod
    def build(cls, entries: Iterable[TenantEntry]) -> TenantCatalog:
        tenants: dict[str, TenantEntry] = {}
        keys: dict[str, ApiKey] = {}
        for entry in entries:
            tenants[entry.tenant.id] = entry
            for key in entry.keys:
                if key.tenant_id == entry.tenant.id:
                    keys[key.key_id] = key
        return cls(MappingProxyType(tenants), MappingProxyType(keys))


class TenantDirectory:
    """Authenticates API keys and serves tenant configs from the cached catalog."""

    def __init__(self, hasher: KeyHasher, catalog: TenantCatalog | None = None) -> None:
        self._hasher = hasher
        self._catalog = catalog or TenantCatalog()
        self._write_lock = threading.Lock()
        metrics.TENANTS_CACHED.set(len(self._catalog.tenants))

    # -- reads (hot path) -----------------------------------------------------------------------
    @property
    def catalog(self) -> TenantCatalog:
        return self._catalog

    def __len__(self) -> int:
        return len(self._catalog.tenants)

    def authenticate(self, token: str, *, now: datetime | None = None) -> Principal:
        """Map an API key (or an ``authorization`` header value) to its tenant, or raise.

        Unknown, malformed, tampered, revoked and expired keys, and keys of a deleted tenant, all raise
        the same :class:`AuthenticationError` after the same work (one HMAC, one constant-time compare).
        A suspended tenant's valid key does authenticate: the caller checks status (see ``policy``) and
        answers PERMISSION_DENIED, which is a more useful answer for a legitimate key holder.
        """
        token = strip_bearer(token) if isinstance(token, str) else ""
        now = now or utcnow()
        catalog = self._catalog
        key_id = parse_key_id(token)
        record = catalog.keys.get(key_id) if key_id is not None else None
        if record is not None:
            matches = self._hasher.verify(token, record.digest, record.secret_id)
        else:
            matches = self._hasher.verify(token, self._hasher.dummy_digest, self._hasher.secret_id)
        entry = catalog.tenants.get(record.tenant_id) if record is not None else None
        valid = record is not None and record.is_valid_at(now)
        if matches and valid and entry is not None:
            return Principal(tenant=entry.tenant, key_id=record.key_id)  # type: ignore[union-attr]
        metrics.AUTH_FAILURES.labels(reason=_reason(key_id, record, matches, valid, entry)).inc()
        raise AuthenticationError()

    def get(self, tenant_id: str) -> Tenant | None:
        entry = self._catalog.tenants.get(tenant_id)
        return entry.tenant if entry else None

    def tenants(self) -> list[Tenant]:
        return [e.tenant for e in self._catalog.tenants.values()]

    def version_of(self, tenant_id: str) -> int | None:
        entry = self._catalog.tenants.get(tenant_id)
        return entry.version if entry else None

    def versions(self) -> dict[str, int]:
        return {tid: e.version for tid, e in self._catalog.tenants.items()}

    # -- writes (watchers) ----------------------------------------------------------------------
    def replace(self, catalog: TenantCatalog) -> None:
        """Swap in a whole new catalog (file reload, full resync)."""
        with self._write_lock:
            self._catalog = catalog
            metrics.TENANTS_CACHED.set(len(catalog.tenants))

    def apply(self, upserts: Iterable[TenantEntry] = (), removals: Iterable[str] = ()) -> int:
        """Apply changed tenants; an entry older than the cached one is ignored (late, reordered reply).

        Returns how many tenants actually changed.
        """
        with self._write_lock:
            tenants = dict(self._catalog.tenants)
            changed = 0
            for tenant_id in removals:
                if tenants.pop(tenant_id, None) is not None:
                    changed += 1
            for entry in upserts:
                current = tenants.get(entry.tenant.id)
                if current is not None and current.version > entry.version:
                    continue
                tenants[entry.tenant.id] = entry
                changed += 1
            if changed:
                self._catalog = TenantCatalog.build(tenants.values())
                metrics.TENANTS_CACHED.set(len(self._catalog.tenants))
            return changed


def _reason(
    key_id: str | None, record: ApiKey | None, matches: bool, valid: bool, entry: TenantEntry | None
) -> str:
    """Why authentication failed: for the server-side metric only, never returned to the caller."""
    if key_id is None:
        return "malformed"
    if record is None:
        return "unknown"
    if not matches:
        return "mismatch"
    if not valid:
        return "expired_or_revoked"
    if entry is None:
        return "unknown_tenant"
    return "other"
