"""Keeps a gateway's ``TenantDirectory`` in sync with the Redis tenant store (asyncio).

Three mechanisms, each covering the others' gaps:

* pub/sub: every admin change is announced; the watcher refetches that one tenant (milliseconds);
* periodic resync: compare the global config revision, and if it moved, every tenant's revision;
  refetch what differs. This heals a missed message (pub/sub is at-most-once);
* resync after every (re)subscription, since announcements made while unsubscribed are lost.

A dead subscription is noticed by PINGs on it. When Redis is unreachable the cache keeps serving the
last known config (fail-static for configuration in both failure modes). A store that answers but
holds no config at all (a Redis restarted without persistence) never wipes a non-empty cache: that
is logged as an error and the cache is kept until an admin writes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from tenancy import metrics
from tenancy.directory import TenantDirectory, TenantEntry
from tenancy.errors import StoreUnavailableError, TenancyError
from tenancy.redis_client import async_client, async_pubsub_client
from tenancy.redis_layout import RedisLayout
from tenancy.settings import TenancySettings
from tenancy.store_redis import decode_entry
from tenancy.tasks import cancel_and_wait

log = logging.getLogger(__name__)

STOP_WAIT_S = 1.0  # how long stop() waits for a cancelled task before closing its connections


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisTenantWatcher:
    def __init__(
        self,
        client: aioredis.Redis,
        directory: TenantDirectory,
        *,
        layout: RedisLayout | None = None,
        resync_interval_s: float = 30.0,
        pubsub_client: aioredis.Redis | None = None,
        retry_interval_s: float = 1.0,
        ping_interval_s: float | None = None,
    ) -> None:
        self._client = client
        self._sub_client = pubsub_client or client
        self._directory = directory
        self._layout = layout or RedisLayout()
        self._resync_interval_s = resync_interval_s
        self._retry_interval_s = retry_interval_s
        self._ping_interval_s = ping_interval_s or min(10.0, resync_interval_s)
        self._seen_version: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._owned: list[aioredis.Redis] = []
        self._subscribed = asyncio.Event()
        self._resync_lock = asyncio.Lock()
        self._last_sync_ok: float | None = None
        self._store_empty_logged = False

    @classmethod
    def from_settings(cls, settings: TenancySettings, directory: TenantDirectory) -> RedisTenantWatcher:
        client = async_client(settings.redis_dsn, timeout_s=settings.redis_timeout_s, max_connections=8)
        sub = async_pubsub_client(settings.redis_dsn, timeout_s=settings.redis_timeout_s)
        watcher = cls(
            client,
            directory,
            layout=RedisLayout(settings.key_prefix),
            resync_interval_s=settings.resync_interval_s,
            pubsub_client=sub,
            retry_interval_s=settings.redis_probe_interval_s,
        )
        watcher._owned = [client, sub]
        return watcher

    async def start(self, *, require_initial: bool = False) -> None:
        """Load the catalog, then follow changes in the background.

        With ``require_initial`` a store that does not answer raises; otherwise the watcher starts
        anyway (serving whatever the directory holds) and keeps trying.
        """
        try:
            await self.resync(trigger="start")
        except StoreUnavailableError:
            if require_initial:
                raise
            log.error("tenant store unreachable at start; serving %d cached tenants", len(self._directory))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._listen(), name="tenancy-pubsub"),
            loop.create_task(self._resync_loop(), name="tenancy-resync"),
        ]

    async def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self._subscribed.wait()

    async def stop(self) -> None:
        """Cancel the watch and close its connections. A task cancelled inside a Redis read can stay
        stuck in it (seen: 11 s, and a test that never ended), so the wait is bounded and the
        connections are closed under a stuck task, which ends its read."""
        stuck = await cancel_and_wait(self._tasks, timeout_s=STOP_WAIT_S, rounds=1)
        for client in self._owned:
            with contextlib.suppress(Exception):
                await client.aclose()
        self._owned = []
        # Their reads have failed by now: the cancels land (and a reconnect must not follow).
        for task in await cancel_and_wait(stuck, timeout_s=STOP_WAIT_S):
            log.warning("tenant watch task %s did not stop; abandoned", task.get_name())
        self._tasks = []

    # -- resync -----------------------------------------------------------------------------------
    async def resync(self, *, trigger: str = "periodic") -> int:
        """Bring the cache up to date with the store; returns how many tenants changed."""
        async with self._resync_lock:
            try:
                changed = await self._resync()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError) as exc:
                metrics.REDIS_ERRORS.labels(op="resync").inc()
                raise StoreUnavailableError(f"tenant store unreachable: {exc}") from exc
            self._last_sync_ok = time.monotonic()
            if changed:
                metrics.CONFIG_RELOADS.labels(source="redis", trigger=trigger).inc()
                log.info("tenant cache resynced (%s): %d tenants changed", trigger, changed)
            return changed

    async def _resync(self) -> int:
        lay = self._layout
        raw_version = await self._client.get(lay.config_version)
        if raw_version is None:
            if len(self._directory):
                if not self._store_empty_logged:
                    log.error(
                        "tenant store has no config (was Redis restarted without persistence?); "
                        "keeping the %d cached tenants until an admin writes again",
                        len(self._directory),
                    )
                    self._store_empty_logged = True
                return 0
            self._seen_version = 0
            return 0
        self._store_empty_logged = False
        version = int(raw_version)
        if version == self._seen_version:
            return 0
        stored = {_text(k): int(v) for k, v in (await self._client.hgetall(lay.tenant_versions)).items()}
        cached = self._directory.versions()
        removals = [tid for tid in cached if tid not in stored]
        stale = [tid for tid, v in stored.items() if cached.get(tid) != v]
        upserts = await self._fetch(stale)
        changed = self._directory.apply(upserts, removals)
        self._seen_version = version
        return changed

    async def _fetch(self, tenant_ids: list[str]) -> list[TenantEntry]:
        if not tenant_ids:
            return []
        lay = self._layout
        pipe = self._client.pipeline(transaction=True)
        for tid in tenant_ids:
            pipe.get(lay.tenant(tid))
            pipe.hget(lay.tenant_versions, tid)
            pipe.hgetall(lay.tenant_keys(tid))
        results = await pipe.execute()
        entries: list[TenantEntry] = []
        for i, tid in enumerate(tenant_ids):
            raw, version, keys = results[3 * i : 3 * i + 3]
            if raw is None or version is None:
                continue  # deleted meanwhile: the next announcement or resync removes it
            try:
                entries.append(decode_entry(raw, int(version), keys))
            except (TenancyError, ValueError) as exc:
                # One bad record must not block every other tenant's updates.
                log.error("ignoring invalid stored config of tenant %r: %s", tid, exc)
        return entries

    async def refresh(self, tenant_id: str) -> bool:
        """Refetch one tenant (after an announcement); returns whether the cache changed."""
        entries = await self._fetch([tenant_id])
        changed = self._directory.apply(entries) if entries else self._directory.apply(removals=[tenant_id])
        if changed:
            metrics.CONFIG_RELOADS.labels(source="redis", trigger="pubsub").inc()
        return bool(changed)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self._resync_interval_s)
            with contextlib.suppress(StoreUnavailableError):
                await self.resync(trigger="periodic")

    # -- pub/sub ----------------------------------------------------------------------------------
    async def _listen(self) -> None:
        first = True
        failures = 0
        while True:
            pubsub = self._sub_client.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(self._retry_interval_s * 2 + 1):
                    await pubsub.subscribe(self._layout.changes_channel)
                self._subscribed.set()
                if not first or self._last_sync_ok is None:
                    # Announcements made while we were not subscribed are lost (and a failed initial
                    # load has not happened at all): resync now.
                    if not first:
                        log.info("tenant change subscription restored")
                    with contextlib.suppress(StoreUnavailableError):
                        await self.resync(trigger="resubscribe")
                first = False
                failures = 0
                await self._consume(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._subscribed.clear()
                failures += 1
                if failures == 1:
                    log.warning("tenant change subscription lost (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(self._retry_interval_s)
            finally:
                # Typed from redis-py 8.2 on, untyped before: called through Any for both.
                aclose: Any = pubsub.aclose
                with contextlib.suppress(Exception):
                    await aclose()

    async def _consume(self, pubsub: Any) -> None:
        last_heard = time.monotonic()
        last_ping = last_heard
        while True:
            message = await pubsub.get_message(timeout=min(1.0, self._ping_interval_s))
            now = time.monotonic()
            if message is not None:
                last_heard = now
                if message.get("type") == "message":
                    await self._on_message(message.get("data"))
            if now - last_ping >= self._ping_interval_s:
                if now - last_heard > 2 * self._ping_interval_s + 1:
                    raise ConnectionError("no answer to PING on the change subscription")
                await pubsub.ping()
                last_ping = now

    async def _on_message(self, data: Any) -> None:
        try:
            payload = json.loads(data)
            tenant_id = str(payload["tenant"])
            version = int(payload["version"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring malformed tenant change announcement")
            return
        cached = self._directory.version_of(tenant_id)
        if cached is not None and cached >= version and payload.get("op") != "delete_tenant":
            return
        try:
            await self.refresh(tenant_id)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError):
            metrics.REDIS_ERRORS.labels(op="refresh").inc()  # the periodic resync will catch up
