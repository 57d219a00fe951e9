"""One object that wires the tenancy pieces for a gateway process, from settings.

    tenancy = Tenancy.from_settings(TenancySettings())
    await tenancy.start()
    principal = tenancy.authenticate(metadata["authorization"])        # no I/O
    tenancy.check_request(principal.tenant, model=..., prompt_tokens=..., max_tokens=...)
    admission = await tenancy.admission.admit(principal.tenant, request_id, prompt_tokens, max_tokens)
    ...
    await tenancy.stop()

Store ``redis``: directory fed by ``RedisTenantWatcher``, admission by ``RedisAdmission``.
Store ``file``: directory fed by ``FileTenantWatcher``, admission by ``LocalAdmission`` whose usage is
persisted next to the tenants file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from tenancy.admission import QuotaEnforcer, QuotaMode
from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.directory import TenantDirectory
from tenancy.keys import KeyHasher
from tenancy.models import Principal, Tenant
from tenancy.policy import check_request
from tenancy.settings import TenancySettings
from tenancy.store_file import (
    ensure_default_tenants_file,
    load_usage_file,
    save_usage_file,
    usage_path_for,
)
from tenancy.watch_file import FileTenantWatcher
from tenancy.watch_redis import RedisTenantWatcher

log = logging.getLogger(__name__)

PREFIX_CACHE_SALT_LABEL = "loom-prefix-cache-salt"
_USAGE_FLUSH_INTERVAL_S = 10.0


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
        self._usage_path = usage_path
        self._usage_saved = -1
        self._flush_task: asyncio.Task[None] | None = None

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
            settings, hasher, directory, local, watcher, usage_path=usage_path_for(settings.tenants_file)
        )

    async def start(self) -> None:
        if isinstance(self.admission, LocalAdmission) and self._usage_path is not None:
            self.admission.load_usage(load_usage_file(self._usage_path))
            self._usage_saved = self.admission.usage_revision
            self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop(), name="usage-flush")
        await self.watcher.start()
        await self.admission.start()

    async def stop(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
            self._flush_task = None
        self.flush_usage()
        await self.watcher.stop()
        await self.admission.close()

    def flush_usage(self) -> None:
        """Persist the embedded limiter's usage if it changed (no-op for Redis: usage lives there)."""
        if not isinstance(self.admission, LocalAdmission) or self._usage_path is None:
            return
        revision = self.admission.usage_revision
        if revision != self._usage_saved:
            save_usage_file(self._usage_path, self.admission.usage_snapshot())
            self._usage_saved = revision

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(_USAGE_FLUSH_INTERVAL_S)
            try:
                self.flush_usage()
            except OSError:
                log.exception("could not persist usage to %s", self._usage_path)

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
