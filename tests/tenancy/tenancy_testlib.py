"""Helpers shared by the tenancy tests (a uniquely named module: tests/ dirs are not packages)."""

from __future__ import annotations

import uuid
from typing import Any

from tenancy.models import Quotas, Tenant
from tests.helpers import eventually  # noqa: F401  (re-exported for the tenancy tests)

TEST_SECRET = "test-server-secret-0123456789abcdef"


def make_tenant(tenant_id: str | None = None, **quota_overrides: Any) -> Tenant:
    """A tenant with generous limits except the ones given (``None`` = unlimited)."""
    quotas = Quotas(**{**Quotas.unlimited().model_dump(), **quota_overrides})  # validated
    return Tenant(id=tenant_id or f"t-{uuid.uuid4().hex[:8]}", quotas=quotas)


def rid() -> str:
    return f"req-{uuid.uuid4().hex}"


def hammer_process(
    settings_values: dict[str, Any],
    scenarios: list[tuple[str, int, int, int]],
    barrier: Any,
    results: Any,
) -> None:
    """Child process body for the global-limit tests (spawned: a fresh interpreter per child).

    For each scenario ``(tenant json, attempts, prompt_tokens, max_tokens)``: wait at the barrier with
    the others, then fire the attempts (8 in flight) and report ``(granted, limit, retry_after_s)``
    per attempt, plus the wall-clock span of the burst.
    """
    import asyncio
    import os
    import time

    from tenancy.admission_redis import RedisAdmission
    from tenancy.models import Tenant
    from tenancy.settings import TenancySettings

    async def run() -> None:
        enforcer = RedisAdmission.from_settings(TenancySettings(**settings_values))
        await enforcer._client.ping()  # connect before the start line
        try:
            for tenant_json, attempts, prompt, max_tokens in scenarios:
                tenant = Tenant.model_validate_json(tenant_json)
                gate = asyncio.Semaphore(8)

                async def one(
                    i: int,
                    tenant: Tenant = tenant,
                    gate: asyncio.Semaphore = gate,
                    prompt: int = prompt,
                    max_tokens: int = max_tokens,
                ) -> tuple:
                    async with gate:
                        a = await enforcer.admit(tenant, f"p{os.getpid()}-{i}", prompt, max_tokens)
                        return (
                            a.granted,
                            a.limit.value if a.limit else None,
                            a.retry_after_s,
                            a.backend.value,
                        )

                barrier.wait()
                start = time.time()
                outcome = await asyncio.gather(*(one(i) for i in range(attempts)))
                results.put((tenant.id, start, time.time(), outcome))
        finally:
            await enforcer.close()

    asyncio.run(run())


def hold_leases_process(settings_values: dict[str, Any], tenant_json: str, count: int, ready: Any) -> None:
    """Child process: take ``count`` leases, report their ids, then hang until killed (never finishes)."""
    import asyncio
    import time

    from tenancy.admission_redis import RedisAdmission
    from tenancy.models import Tenant
    from tenancy.settings import TenancySettings

    async def run() -> list[str]:
        enforcer = RedisAdmission.from_settings(TenancySettings(**settings_values))
        tenant = Tenant.model_validate_json(tenant_json)
        ids = []
        for i in range(count):
            admission = await enforcer.admit(tenant, f"held-{i}", 1, 1)
            assert admission.granted, admission
            ids.append(admission.request_id)
        return ids

    ready.put(asyncio.run(run()))
    while True:
        time.sleep(60)


def quota_status(enforcer: Any, settings: Any, tenant_id: str) -> dict[str, int]:
    """Active leases and budget tokens used today / this month, from either implementation."""
    from tenancy.admission_local import LocalAdmission
    from tenancy.store_redis import RedisTenantStore

    if isinstance(enforcer, LocalAdmission):
        return enforcer.quota_status(tenant_id)
    store = RedisTenantStore.from_settings(settings)
    try:
        return store.quota_status(tenant_id)
    finally:
        store.close()


def usage_today(enforcer: Any, settings: Any, tenant_id: str) -> Any:
    """Today's metered usage (a ``DailyUsage``) from either implementation."""
    from tenancy.admission_local import LocalAdmission
    from tenancy.store_redis import RedisTenantStore

    if isinstance(enforcer, LocalAdmission):
        return enforcer.usage(tenant_id, 1)[-1]
    store = RedisTenantStore.from_settings(settings)
    try:
        return store.usage(tenant_id, 1)[-1]
    finally:
        store.close()


def reported_completion(enforcer: Any, settings: Any, tenant_id: str, request_id: str) -> int | None:
    """The completion tokens stored with a running request's lease by its last renewal."""
    import redis as redis_sync

    from tenancy.admission_local import LocalAdmission
    from tenancy.redis_layout import RedisLayout

    if isinstance(enforcer, LocalAdmission):
        record = enforcer._records.get((tenant_id, request_id))
        return None if record is None else record.completion
    client = redis_sync.Redis.from_url(settings.redis_url)
    try:
        value = client.hget(RedisLayout(settings.key_prefix).request(tenant_id, request_id), "completion")
    finally:
        client.close()
    return None if value is None else int(value)


def hold_and_hang_process(
    settings_values: dict[str, Any],
    tenant_json: str,
    prompt: int,
    max_tokens: int,
    delivered: int,
    ready: Any,
) -> None:
    """Child process: admit, stream inside ``hold()`` with ``delivered`` completion tokens counted
    (the background renewal reports them), report the request id, then hang until killed."""
    import asyncio

    from tenancy.admission_redis import RedisAdmission
    from tenancy.models import Tenant
    from tenancy.settings import TenancySettings

    async def run() -> None:
        enforcer = RedisAdmission.from_settings(TenancySettings(**settings_values))
        tenant = Tenant.model_validate_json(tenant_json)
        admission = await enforcer.admit(tenant, "held-stream", prompt, max_tokens)
        assert admission.granted, admission
        async with enforcer.hold(tenant, admission) as lease:
            lease.completion_tokens = delivered
            ready.put(admission.request_id)
            await asyncio.sleep(3600)

    asyncio.run(run())


def dump_prefix(client: Any, prefix: str) -> bytes:
    """Every key name and value under ``prefix``, whatever its type, as one blob."""
    out = []
    for key in client.scan_iter(match=f"{prefix}:*"):
        kind = client.type(key)
        out.append(key)
        if kind == b"string":
            out.append(client.get(key))
        elif kind == b"hash":
            out.extend(b"%s=%s" % kv for kv in client.hgetall(key).items())
        elif kind == b"zset":
            out.extend(m for m, _ in client.zrange(key, 0, -1, withscores=True))
        elif kind == b"set":
            out.extend(client.smembers(key))
        elif kind == b"stream":
            for _, fields in client.xrange(key):
                out.extend(b"%s=%s" % kv for kv in fields.items())
        elif kind == b"list":
            out.extend(client.lrange(key, 0, -1))
    return b"\n".join(out)
