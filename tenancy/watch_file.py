"""Keeps a ``TenantDirectory`` in sync with the embedded tenants file by polling its metadata.

Polling ``(mtime, size, inode)`` once a second costs one ``stat`` and works on every filesystem and
editor (atomic renames included), where inotify-style watching would need an extra dependency. A file
that fails validation is refused with a log line and the previous config stays in force, so a typo in
a hand edit can never take a running server's tenants away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from tenancy import metrics
from tenancy.directory import TenantDirectory
from tenancy.errors import TenantValidationError
from tenancy.store_file import load_catalog

log = logging.getLogger(__name__)


class FileTenantWatcher:
    def __init__(self, path: Path, directory: TenantDirectory, *, poll_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self._directory = directory
        self._poll_interval_s = poll_interval_s
        self._signature: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload(self, *, force: bool = False, strict: bool = False) -> bool:
        """Load the file if it changed since the last load. Returns whether the cache was replaced.

        ``strict`` raises on an invalid or missing file (used at start-up: fail fast, not empty).
        """
        signature = self._stat()
        if signature is None:
            if strict:
                raise TenantValidationError(f"tenants file {self.path} does not exist")
            return False
        if signature == self._signature and not force:
            return False
        try:
            catalog = load_catalog(self.path)
        except (TenantValidationError, OSError) as exc:
            if strict:
                raise
            if signature != self._signature:
                log.error("not reloading %s, keeping the previous tenants: %s", self.path, exc)
            self._signature = signature
            return False
        self._signature = signature
        self._directory.replace(catalog)
        metrics.CONFIG_RELOADS.labels(source="file", trigger="change" if not force else "start").inc()
        log.info("loaded %d tenants from %s", len(catalog.tenants), self.path)
        return True

    async def start(self) -> None:
        self.reload(force=True, strict=True)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll(), name="tenancy-file-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                self.reload()
            except Exception:  # never let the watcher die
                log.exception("tenants file watcher failed")
