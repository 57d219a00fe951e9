"""The admin interface of a tenant store, and the store-independent rules of admin changes.

Two implementations: ``RedisTenantStore`` (clusters; the admin CLI's default) and ``FileTenantStore``
(the embedded single-node store). Both are synchronous: admin tooling is not latency-sensitive, and
the gateway never writes config. The gateway reads through a ``TenantDirectory`` kept fresh by a
watcher instead (``watch_redis`` / ``watch_file``).
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from pydantic import ValidationError

from tenancy.errors import TenantValidationError
from tenancy.keys import KeyHasher
from tenancy.models import (
    ApiKey,
    AuditEntry,
    DailyUsage,
    IssuedKey,
    Tenant,
    TenantStatus,
    describe_validation_error,
    utcnow,
)

# Fields an admin may change with ``update``; id, version and timestamps belong to the store.
UPDATABLE_FIELDS = frozenset(
    {
        "display_name",
        "status",
        "priority_ceiling",
        "default_priority",
        "weight",
        "kv_floor",
        "kv_cap",
        "speculative",
        "quotas",
        "slo",
        "allowed_models",
        "pool",
        "dedicated_pool",
        "adapters",
    }
)


def default_actor() -> str:
    """``user@host`` of whoever runs the admin tool, for the audit trail."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@runtime_checkable
class TenantAdmin(Protocol):
    """Admin operations every store supports. ``actor`` is recorded in the audit trail."""

    def create_tenant(self, tenant: Tenant, *, actor: str) -> Tenant: ...

    def get_tenant(self, tenant_id: str) -> Tenant: ...

    def list_tenants(self) -> list[Tenant]: ...

    def update_tenant(self, tenant_id: str, changes: Mapping[str, Any], *, actor: str) -> Tenant: ...

    def set_status(self, tenant_id: str, status: TenantStatus, *, actor: str) -> Tenant: ...

    def delete_tenant(self, tenant_id: str, *, actor: str) -> None: ...

    def create_key(
        self, tenant_id: str, *, actor: str, name: str = "", expires_at: datetime | None = None
    ) -> IssuedKey: ...

    def list_keys(self, tenant_id: str) -> list[ApiKey]: ...

    def revoke_key(self, key_id: str, *, actor: str, grace_s: float = 0.0) -> ApiKey: ...

    def rotate_key(self, key_id: str, *, actor: str, grace_s: float = 3600.0) -> IssuedKey: ...

    def usage(self, tenant_id: str, days: int = 30) -> list[DailyUsage]: ...

    def audit_log(self, count: int = 50) -> list[AuditEntry]: ...


def apply_changes(tenant: Tenant, changes: Mapping[str, Any]) -> Tenant:
    """``tenant`` with ``changes`` applied and validated; ``quotas`` may be a partial mapping, and so
    may ``slo`` (by class; a class mapped to None loses its target).

    Raises :class:`TenantValidationError` naming every bad field (and any field that is not updatable).
    """
    unknown = sorted(set(changes) - UPDATABLE_FIELDS)
    if unknown:
        raise TenantValidationError(
            f"cannot update {', '.join(unknown)}; updatable fields: {', '.join(sorted(UPDATABLE_FIELDS))}"
        )
    data = tenant.config_dict()
    for field, value in changes.items():
        if field == "quotas" and isinstance(value, Mapping):
            data["quotas"] = {**data["quotas"], **value}
        elif field == "slo" and isinstance(value, Mapping):  # by class; None removes a class's target
            merged = {**data["slo"], **{str(k): v for k, v in value.items()}}
            data["slo"] = {k: v for k, v in merged.items() if v is not None}
        else:
            data[field] = value.value if hasattr(value, "value") else value
    data["updated_at"] = utcnow().isoformat()
    try:
        return Tenant.model_validate({**data, "version": tenant.version})
    except ValidationError as exc:
        raise TenantValidationError(describe_validation_error(exc, "tenant")) from None


def diff(old: Tenant | None, new: Tenant | None) -> dict[str, list[Any]]:
    """``{field: [old, new]}`` of admin-visible fields that differ (quotas field by field)."""
    before = old.config_dict() if old else {}
    after = new.config_dict() if new else {}
    out: dict[str, list[Any]] = {}
    for field in sorted(set(before) | set(after)):
        if field in ("created_at", "updated_at"):
            continue
        a, b = before.get(field), after.get(field)
        if field == "quotas" and isinstance(a, dict | None) and isinstance(b, dict | None):
            for q in sorted(set(a or {}) | set(b or {})):
                qa, qb = (a or {}).get(q), (b or {}).get(q)
                if qa != qb:
                    out[f"quotas.{q}"] = [qa, qb]
        elif a != b:
            out[field] = [a, b]
    return out


def key_summary(key: ApiKey) -> dict[str, Any]:
    """What the audit trail says about a key: never its digest."""
    return {
        "name": key.name,
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }


def new_tenant(tenant: Tenant) -> Tenant:
    """``tenant`` stamped for creation (timestamps set, version reset)."""
    now = utcnow()
    return tenant.model_copy(update={"created_at": now, "updated_at": now, "version": 0})


class SharedAdminCommands:
    """The admin commands both stores implement the same way, on top of their own primitives
    (``get_key``, ``revoke_key``, ``_put_key``, ``_update`` and the ``_hasher``)."""

    _hasher: KeyHasher

    def get_key(self, key_id: str) -> ApiKey:
        raise NotImplementedError

    def revoke_key(self, key_id: str, *, actor: str, grace_s: float = 0.0) -> ApiKey:
        raise NotImplementedError

    def _put_key(self, key: ApiKey, *, actor: str, action: str, changes: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, tenant_id: str, changes: Mapping[str, Any], *, actor: str, action: str) -> Tenant:
        raise NotImplementedError

    def update_tenant(self, tenant_id: str, changes: Mapping[str, Any], *, actor: str) -> Tenant:
        return self._update(tenant_id, changes, actor=actor, action="tenant.update")

    def set_status(self, tenant_id: str, status: TenantStatus, *, actor: str) -> Tenant:
        action = "tenant.suspend" if status is TenantStatus.SUSPENDED else "tenant.activate"
        return self._update(tenant_id, {"status": status}, actor=actor, action=action)

    def rotate_key(self, key_id: str, *, actor: str, grace_s: float = 3600.0) -> IssuedKey:
        """A new key for the same tenant; the old one keeps working for ``grace_s`` (overlap)."""
        old = self.get_key(key_id)
        issued = self._hasher.issue(old.tenant_id, name=old.name, created_by=actor, expires_at=old.expires_at)
        self._put_key(
            issued.record,
            actor=actor,
            action="key.rotate",
            changes={**key_summary(issued.record), "replaces": old.key_id},
        )
        self.revoke_key(key_id, actor=actor, grace_s=grace_s)
        return issued
