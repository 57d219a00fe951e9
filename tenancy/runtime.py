"""One object that wires the tenancy pieces for a gateway process, from settings.

    tenancy = Tenancy.from_settings(TenancySettings())
    await tenancy.start()
    principal = tenancy.authenticate(metadata["authorization"])        # no I/O
    tenancy.check_request(principal.tenant, model=..., prompt_tokens=..., max_tokens=...)
    admission = await tenancy.admission.admit(principal.tenant, request_id, prompt_tokens, max_tokens)
    ...
    await tenancy.stop()

Store ``redis``: directory fed by ``RedisTenantWatcher``, admission by ``RedisAdmission``.
Store ``file``: directory fed by ``FileTenantWatcher``, admission by ``LocalAdmission`` whose quota
state (usage, daily/monthly budgets, running reservations) is persisted next to the tenants file,
every ``state_flush_interval_s`` and at stop, and reloaded at start.

Both: a background task settles lapsed leases (gateways that died mid-stream) every
``lease_sweep_interval_s``, so that tenants with no traffic get theirs settled too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from tenancy import metrics
from tenancy.admission import QuotaEnforcer, QuotaMode
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.directory import TenantDirectory
from tenancy.keys import KeyHasher
from tenancy.models import Principal, Tenant
from tenancy.policy import check_request
from tenancy.settings import TenancySettings
from tenancy.store_file import (
    StateFileError,
    empty_state,
    ensure_default_tenants_file,
    quarantine_state_file,
    read_state_file,
    save_state_file,
    state_path_for,
)
from tenancy.tasks import cancel_and_wait
from tenancy.watch_file import FileTenantWatcher
from tenancy.watch_redis import RedisTenantWatcher

log = logging.getLogger(__name__)

PREFIX_CACHE_SALT_LABEL = "loom-prefix-cache-salt"


def bootstrap_embedded(settings: TenancySettings) -> str | None:
    """For the embedded store: create the tenants file with a demo tenant if there is none.

    Returns the demo API key to print once (``None`` if the file existed or the store is Redis).
    """
    if settings.store != "file":
        return None
    return ensure_default_tenants_file(settings.tenants_file, settings.hasher())


class Tenancy:
    def __init__(
        self,
        settings: TenancySettings,
        hasher: KeyHasher,
        directory: TenantDirectory,
        admission: QuotaEnforcer,
        watcher: RedisTenantWatcher | FileTenantWatcher,
        *,
        usage_path: Path | None = None,
    ) -> None:
        self.settings = settings
        self._hasher = hasher
        self.directory = directory
        self.admission = admission
        self.watcher = watcher
        self._state_path = usage_path
        self._state_saved = -1
        self._flush_lock = threading.Lock()
        self._flush_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: TenancySettings | None = None) -> Tenancy:
        settings = settings or TenancySettings()
        hasher = settings.hasher()
        directory = TenantDirectory(hasher)
        if settings.store == "redis":
            return cls(
                settings,
                hasher,
                directory,
                RedisAdmission.from_settings(settings),
                RedisTenantWatcher.from_settings(settings, directory),
            )
        local = LocalAdmission(
            lease_ttl_s=settings.lease_ttl_s,
            record_grace_s=settings.record_grace_s,
            finished_ttl_s=settings.finished_ttl_s,
            concurrency_retry_hint_s=settings.concurrency_retry_hint_s,
            usage_retention_days=settings.usage_retention_days,
        )
        watcher = FileTenantWatcher(
            settings.tenants_file, directory, poll_interval_s=settings.file_poll_interval_s
        )
        return cls(
            settings, hasher, directory, local, watcher, usage_path=state_path_for(settings.tenants_file)
        )

    @property
    def state_path(self) -> Path | None:
        """The embedded store's quota state file (``None`` for Redis: the state lives there)."""
        return self._state_path if isinstance(self.admission, LocalAdmission) else None

    async def start(self) -> None:
        if self.state_path is not None:
            self.load_state()
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop(), name="state-flush")
        await self.watcher.start()
        await self.admission.start()
        self._sweep_task = asyncio.get_running_loop().create_task(self._sweep_loop(), name="lease-sweep")

    async def stop(self) -> None:
        running = [t for t in (self._sweep_task, self._flush_task) if t is not None]
        for task in await cancel_and_wait(running):
            log.warning("background task %s did not stop; abandoned", task.get_name())
        self._sweep_task = self._flush_task = None
        try:
            self.flush_state()
        except OSError:
            metrics.STATE_FILE_ERRORS.labels(op="save").inc()
            log.exception("could not persist the quota state to %s at stop", self._state_path)
        await self.watcher.stop()
        await self.admission.close()

    def load_state(self) -> None:
        """Embedded store: restore budgets and usage from the state file into the local limiter.

        Requests that were running when the previous process stopped are settled at once (charged
        their prompt + the completion tokens of their last renewal). An unreadable file does not
        stop the start: it is moved aside, an ERROR says that budgets and usage restart from zero.
        """
        path = self.state_path
        if path is None:
            return
        assert isinstance(self.admission, LocalAdmission)
        try:
            state = read_state_file(path)
        except StateFileError as exc:
            metrics.STATE_FILE_ERRORS.labels(op="load").inc()
            moved = quarantine_state_file(path)
            log.error(
                "QUOTA STATE NOT RESTORED: %s. Daily and monthly budgets and usage of every tenant start "
                "from ZERO. The unreadable file was %s.",
                exc,
                f"moved to {moved}" if moved else "left in place (could not be moved; a write replaces it)",
            )
            state = empty_state()
        settled = self.admission.load_state(state)
        if settled:
            log.warning(
                "settled %d requests that were running when the previous process stopped "
                "(charged prompt + the completion tokens of their last renewal)",
                settled,
            )
        else:
            self._state_saved = self.admission.state_revision

    def flush_state(self) -> bool:
        """Embedded store: write the quota state file if anything changed since the last write
        (no-op for Redis). Returns whether it wrote."""
        if self.state_path is None:
            return False
        assert isinstance(self.admission, LocalAdmission)
        with self._flush_lock:  # the periodic write runs in a thread: one writer at a time
            revision = self.admission.state_revision
            if revision == self._state_saved:
                return False
            save_state_file(self.state_path, self.admission.state_snapshot())
            self._state_saved = revision
            return True

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.state_flush_interval_s)
            try:
                await asyncio.to_thread(self.flush_state)
            except OSError:
                metrics.STATE_FILE_ERRORS.labels(op="save").inc()
                log.exception("could not persist the quota state to %s", self._state_path)

    async def sweep(self) -> int:
        """Settle lapsed leases now (the background task does this every ``lease_sweep_interval_s``)."""
        tenants = [entry.tenant for entry in self.directory.catalog.tenants.values()]
        return await self.admission.sweep(tenants)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("settling lapsed leases failed")

    # -- the gateway's per-request calls ------------------------------------------------------------
    def authenticate(self, token: str) -> Principal:
        return self.directory.authenticate(token)

    @staticmethod
    def check_request(tenant: Tenant, *, model: str | None, prompt_tokens: int, max_tokens: int) -> None:
        check_request(tenant, model=model, prompt_tokens=prompt_tokens, max_tokens=max_tokens)

    @property
    def quota_mode(self) -> QuotaMode:
        return self.admission.mode

    def prefix_cache_salt(self, tenant_id: str) -> bytes:
        """The tenant's prefix-cache salt: HMAC of the tenant id with the server secret.

        Derived server-side only (a client never supplies it), stable across replicas and restarts.
        """
        return self._hasher.derive(PREFIX_CACHE_SALT_LABEL, tenant_id)
