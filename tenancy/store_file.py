"""The embedded tenant store: one YAML file, for a single node (the default of ``make run``).

The file holds tenants and, under each, its API keys as keyed hashes only. It may be edited by hand;
a running server notices the change (``watch_file.FileTenantWatcher``) and reloads it, keeping the
previous config if the new file does not validate. Admin commands write it atomically (temp file +
rename) under an advisory lock, and append each change to ``<name>.audit.jsonl`` next to it.

The serving process keeps its quota state in ``usage.json`` in the same folder (see
:func:`save_state_file`): metered usage per day, the daily/monthly budget counters, and the
reservations of the requests running at the time of the write, so that a restart neither resets a
tenant's budgets nor leaves a reservation of a request that died with the process charged in full.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from common import Priority
from tenancy import quota_math as qm
from tenancy.directory import TenantCatalog, TenantEntry
from tenancy.errors import (
    KeyNotFoundError,
    TenantExistsError,
    TenantNotFoundError,
    TenantValidationError,
)
from tenancy.keys import KeyHasher
from tenancy.models import (
    ApiKey,
    AuditEntry,
    DailyUsage,
    IssuedKey,
    Tenant,
    describe_validation_error,
    parse_tenant,
    utcnow,
    validate_tenant_id,
)
from tenancy.store import SharedAdminCommands, apply_changes, diff, key_summary, new_tenant

log = logging.getLogger(__name__)

FILE_FORMAT = 1
_HEADER = (
    "# Loom tenants (embedded single-node store).\n"
    "# Edit and save: a running server reloads this file within seconds; an invalid edit is refused\n"
    "# (logged) and the previous config stays in force. API keys appear only as keyed hashes.\n"
)
DEMO_TENANT_ID = "demo"


def audit_path_for(path: Path) -> Path:
    return path.with_name(path.stem + ".audit.jsonl")


def usage_path_for(path: Path) -> Path:
    """The quota state file (usage, budgets, running reservations) next to the tenants file."""
    return path.with_name("usage.json")


state_path_for = usage_path_for


def load_catalog(path: Path) -> TenantCatalog:
    """Parse and validate the tenants file. Raises :class:`TenantValidationError` on any problem."""
    return TenantCatalog.build(_parse(path.read_text(encoding="utf-8"), str(path))[1])


def _parse(text: str, where: str) -> tuple[int, list[TenantEntry]]:
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise TenantValidationError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise TenantValidationError(f"{where}: expected a mapping with a 'tenants' list")
    revision = int(doc.get("revision", 0) or 0)
    entries: list[TenantEntry] = []
    seen: set[str] = set()
    seen_keys: set[str] = set()
    for i, item in enumerate(doc.get("tenants") or []):
        if not isinstance(item, dict):
            raise TenantValidationError(f"{where}: tenants[{i}] must be a mapping")
        item = dict(item)
        raw_keys = item.pop("keys", None) or []
        try:
            tenant = parse_tenant(item)
        except TenantValidationError as exc:
            raise TenantValidationError(f"{where}: tenants[{i}]: {exc}") from None
        if tenant.id in seen:
            raise TenantValidationError(f"{where}: tenant {tenant.id!r} appears twice")
        seen.add(tenant.id)
        keys = []
        for j, raw_key in enumerate(raw_keys):
            try:
                key = ApiKey.model_validate({**raw_key, "tenant_id": tenant.id})
            except (ValidationError, TypeError) as exc:
                detail = describe_validation_error(exc, "key") if isinstance(exc, ValidationError) else exc
                raise TenantValidationError(f"{where}: tenants[{i}].keys[{j}]: {detail}") from None
            if key.key_id in seen_keys:
                raise TenantValidationError(f"{where}: key id {key.key_id} appears twice")
            seen_keys.add(key.key_id)
            keys.append(key)
        entries.append(TenantEntry(tenant, tuple(keys)))
    return revision, entries


def _dump(revision: int, entries: list[TenantEntry]) -> str:
    tenants = []
    for entry in sorted(entries, key=lambda e: e.tenant.id):
        data = entry.tenant.model_dump(mode="json")
        data["keys"] = [k.model_dump(mode="json", exclude={"tenant_id"}) for k in entry.keys]
        tenants.append(data)
    body = yaml.safe_dump(
        {"format": FILE_FORMAT, "revision": revision, "tenants": tenants}, sort_keys=False, allow_unicode=True
    )
    return _HEADER + body


def _write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (best effort)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class FileTenantStore(SharedAdminCommands):
    """Admin operations on the tenants file (see :class:`tenancy.store.TenantAdmin`)."""

    def __init__(self, path: Path, hasher: KeyHasher) -> None:
        self.path = Path(path)
        self._hasher = hasher

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(f".{self.path.name}.lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> tuple[int, dict[str, TenantEntry]]:
        if not self.path.exists():
            return 0, {}
        revision, entries = _parse(self.path.read_text(encoding="utf-8"), str(self.path))
        return revision, {e.tenant.id: e for e in entries}

    def _commit(
        self,
        revision: int,
        entries: dict[str, TenantEntry],
        *,
        actor: str,
        action: str,
        tenant_id: str,
        changes: Mapping[str, Any],
        key_id: str | None = None,
    ) -> None:
        _write_atomic(self.path, _dump(revision, list(entries.values())))
        entry = {
            "at": utcnow().isoformat(),
            "actor": actor,
            "action": action,
            "tenant": tenant_id,
            "key_id": key_id,
            "version": revision,
            "changes": changes,
        }
        audit = audit_path_for(self.path)
        fd = os.open(audit, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, default=str, sort_keys=True) + "\n")

    # -- tenants ----------------------------------------------------------------------------------
    def create_tenant(self, tenant: Tenant, *, actor: str) -> Tenant:
        with self._locked():
            revision, entries = self._read()
            if tenant.id in entries:
                raise TenantExistsError(tenant.id)
            revision += 1
            created = new_tenant(tenant).model_copy(update={"version": revision})
            entries[tenant.id] = TenantEntry(created)
            self._commit(
                revision,
                entries,
                actor=actor,
                action="tenant.create",
                tenant_id=tenant.id,
                changes=diff(None, created),
            )
            return created

    def get_tenant(self, tenant_id: str) -> Tenant:
        validate_tenant_id(tenant_id)
        entry = self._read()[1].get(tenant_id)
        if entry is None:
            raise TenantNotFoundError(tenant_id)
        return entry.tenant

    def list_tenants(self) -> list[Tenant]:
        return sorted((e.tenant for e in self._read()[1].values()), key=lambda t: t.id)

    def _update(self, tenant_id: str, changes: Mapping[str, Any], *, actor: str, action: str) -> Tenant:
        validate_tenant_id(tenant_id)
        with self._locked():
            revision, entries = self._read()
            entry = entries.get(tenant_id)
            if entry is None:
                raise TenantNotFoundError(tenant_id)
            revision += 1
            updated = apply_changes(entry.tenant, changes).model_copy(update={"version": revision})
            entries[tenant_id] = TenantEntry(updated, entry.keys)
            self._commit(
                revision,
                entries,
                actor=actor,
                action=action,
                tenant_id=tenant_id,
                changes=diff(entry.tenant, updated),
            )
            return updated

    def delete_tenant(self, tenant_id: str, *, actor: str) -> None:
        validate_tenant_id(tenant_id)
        with self._locked():
            revision, entries = self._read()
            entry = entries.pop(tenant_id, None)
            if entry is None:
                raise TenantNotFoundError(tenant_id)
            self._commit(
                revision + 1,
                entries,
                actor=actor,
                action="tenant.delete",
                tenant_id=tenant_id,
                changes=diff(entry.tenant, None),
            )

    # -- keys ---------------------------------------------------------------------------------------
    def create_key(
        self, tenant_id: str, *, actor: str, name: str = "", expires_at: datetime | None = None
    ) -> IssuedKey:
        issued = self._hasher.issue(tenant_id, name=name, created_by=actor, expires_at=expires_at)
        self._put_key(issued.record, actor=actor, action="key.create", changes=key_summary(issued.record))
        return issued

    def _put_key(self, key: ApiKey, *, actor: str, action: str, changes: Mapping[str, Any]) -> None:
        with self._locked():
            revision, entries = self._read()
            entry = entries.get(key.tenant_id)
            if entry is None:
                raise TenantNotFoundError(key.tenant_id)
            keys = (*tuple(k for k in entry.keys if k.key_id != key.key_id), key)
            revision += 1
            entries[key.tenant_id] = TenantEntry(entry.tenant.model_copy(update={"version": revision}), keys)
            self._commit(
                revision,
                entries,
                actor=actor,
                action=action,
                tenant_id=key.tenant_id,
                changes=changes,
                key_id=key.key_id,
            )

    def get_key(self, key_id: str) -> ApiKey:
        for entry in self._read()[1].values():
            for key in entry.keys:
                if key.key_id == key_id:
                    return key
        raise KeyNotFoundError(key_id)

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        validate_tenant_id(tenant_id)
        entry = self._read()[1].get(tenant_id)
        if entry is None:
            raise TenantNotFoundError(tenant_id)
        return sorted(entry.keys, key=lambda k: k.created_at)

    def revoke_key(self, key_id: str, *, actor: str, grace_s: float = 0.0) -> ApiKey:
        key = self.get_key(key_id)
        at = utcnow() + timedelta(seconds=max(0.0, grace_s))
        if key.revoked_at is not None and key.revoked_at <= at:
            return key
        revoked = key.model_copy(update={"revoked_at": at})
        before = key.revoked_at.isoformat() if key.revoked_at else None
        self._put_key(
            revoked, actor=actor, action="key.revoke", changes={"revoked_at": [before, at.isoformat()]}
        )
        return revoked

    # -- usage and audit ----------------------------------------------------------------------------
    def usage(self, tenant_id: str, days: int = 30) -> list[DailyUsage]:
        """Usage persisted by the serving process (``usage.json``), last ``days`` UTC days."""
        validate_tenant_id(tenant_id)
        per_day = load_usage_file(usage_path_for(self.path)).get(tenant_id, {})
        today = datetime.now(UTC).date()
        return [
            DailyUsage(tenant_id=tenant_id, day=d, **per_day.get(d.isoformat(), {}))
            for d in qm.days_back(today, days)
        ]

    def audit_log(self, count: int = 50) -> list[AuditEntry]:
        path = audit_path_for(self.path)
        if not path.exists():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()[-count:]
        out = []
        for n, line in enumerate(reversed(lines)):
            row = json.loads(line)
            out.append(
                AuditEntry(
                    id=str(len(lines) - n),
                    at=row["at"],
                    actor=row.get("actor", ""),
                    action=row.get("action", ""),
                    tenant_id=row.get("tenant", ""),
                    key_id=row.get("key_id"),
                    version=row.get("version"),
                    changes=row.get("changes") or {},
                )
            )
        return out


STATE_FORMAT = 2
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cancelled", "errors", "expired")
_RUNNING_FIELDS = ("reserved", "prompt", "completion")


class StateFileError(ValueError):
    """The quota state file exists but cannot be read or does not validate."""


def empty_state() -> dict[str, Any]:
    return {"usage": {}, "budgets": {}, "running": {}}


def read_state_file(path: Path) -> dict[str, Any]:
    """Read and validate the quota state file (see :func:`save_state_file`); a missing file is an
    empty state. Format 1 (the usage map alone, before budgets were persisted) is read as usage.
    Raises :class:`StateFileError` if the file is unreadable or anything in it is malformed."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return empty_state()
    except OSError as exc:
        raise StateFileError(f"{path}: cannot read: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise StateFileError(f"{path}: not valid JSON: {exc}") from None
    try:
        return _parse_state(data)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StateFileError(f"{path}: {exc}") from None


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: expected an integer >= 0, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping")
    return value


def _period(entry: dict[str, Any], where: str) -> tuple[str, str]:
    day, month = entry["day"], entry["month"]
    try:
        qm.day_from_label(day)
        qm.month_from_label(month)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return day, month


def _parse_state(data: Any) -> dict[str, Any]:
    data = _mapping(data, "top level")
    usage_raw: Any
    budgets_raw: Any
    running_raw: Any
    if "format" not in data:
        usage_raw, budgets_raw, running_raw = data, {}, {}
    elif data["format"] == STATE_FORMAT:
        usage_raw = data.get("usage") or {}
        budgets_raw = data.get("budgets") or {}
        running_raw = data.get("running") or {}
    else:
        raise ValueError(f"unknown format {data['format']!r} (this version reads {STATE_FORMAT})")
    out = empty_state()
    for tid, days in _mapping(usage_raw, "usage").items():
        rows: dict[str, Any] = {}
        out["usage"][tid] = rows
        for label, fields in _mapping(days, f"usage.{tid}").items():
            qm.day_from_label(label)
            where = f"usage.{tid}.{label}"
            rows[label] = {
                f: _count(v, f"{where}.{f}") for f, v in _mapping(fields, where).items() if f in _USAGE_FIELDS
            }
    for tid, entry in _mapping(budgets_raw, "budgets").items():
        where = f"budgets.{tid}"
        entry = _mapping(entry, where)
        day, month = _period(entry, where)
        out["budgets"][tid] = {
            "day": day,
            "day_used": _count(entry["day_used"], f"{where}.day_used"),
            "month": month,
            "month_used": _count(entry["month_used"], f"{where}.month_used"),
        }
    for tid, requests in _mapping(running_raw, "running").items():
        rows = {}
        out["running"][tid] = rows
        for rid, entry in _mapping(requests, f"running.{tid}").items():
            where = f"running.{tid}.{rid}"
            entry = _mapping(entry, where)
            day, month = _period(entry, where)
            rows[rid] = {f: _count(entry[f], f"{where}.{f}") for f in _RUNNING_FIELDS}
            rows[rid].update(day=day, month=month)
    return out


def save_state_file(path: Path, snapshot: dict[str, Any]) -> None:
    """Write the quota state atomically (temp file, fsync, rename)::

    {"format": 2, "saved_at": "<UTC ISO time>",
     "usage":   {tenant: {"YYYY-MM-DD": {"requests": n, "prompt_tokens": n, ...}}},
     "budgets": {tenant: {"day": "YYYY-MM-DD", "day_used": n, "month": "YYYY-MM", "month_used": n}},
     "running": {tenant: {request id: {"reserved": n, "prompt": n, "completion": n,
                                       "day": "YYYY-MM-DD", "month": "YYYY-MM"}}}}
    """
    doc = {"format": STATE_FORMAT, "saved_at": utcnow().isoformat(), **snapshot}
    _write_atomic(Path(path), json.dumps(doc, sort_keys=True, indent=1))


def quarantine_state_file(path: Path) -> Path | None:
    """Move an unreadable state file aside (``<name>.corrupt-<UTC time>``) so that the next write
    does not destroy what an operator may want to recover; returns where it went."""
    path = Path(path)
    target = path.with_name(f"{path.name}.corrupt-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}")
    try:
        os.replace(path, target)
    except OSError:
        return None
    return target


def load_usage_file(path: Path) -> dict[str, dict[str, dict[str, int]]]:
    """The usage section of the state file (``{}`` if missing; logged and ``{}`` if unreadable)."""
    try:
        usage: dict[str, dict[str, dict[str, int]]] = read_state_file(path)["usage"]
        return usage
    except StateFileError as exc:
        log.error("cannot read the usage in %s", exc)
        return {}


def demo_tenant() -> Tenant:
    return Tenant(
        id=DEMO_TENANT_ID,
        display_name="Demo tenant (created by loom on first start)",
        priority_ceiling=Priority.INTERACTIVE,
        default_priority=Priority.STANDARD,
    )


def ensure_default_tenants_file(
    path: Path, hasher: KeyHasher, *, actor: str = "loom-bootstrap"
) -> str | None:
    """Create the tenants file with a demo tenant and a fresh key, unless the file already exists.

    Returns the demo key's plaintext (to print once, e.g. by ``loom serve``), or ``None`` if the file
    existed. The file stores only the key's keyed hash, so the key cannot be recovered later: lose it
    and create another with ``loom admin --store file key create demo``.
    """
    path = Path(path)
    store = FileTenantStore(path, hasher)
    with store._locked():
        if path.exists():
            return None
        tenant = new_tenant(demo_tenant()).model_copy(update={"version": 1})
        issued = hasher.issue(tenant.id, name="demo", created_by=actor)
        entries = {tenant.id: TenantEntry(tenant, (issued.record,))}
        store._commit(
            1,
            entries,
            actor=actor,
            action="tenant.create",
            tenant_id=tenant.id,
            changes=diff(None, tenant),
            key_id=issued.key_id,
        )
    log.info("created %s with tenant %r and one API key (id %s)", path, tenant.id, issued.key_id)
    return issued.plaintext.get_secret_value()
