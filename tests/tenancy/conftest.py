"""Fixtures of the tenancy tests (the Redis harness itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis
from tenancy_testlib import TEST_SECRET

from tenancy.admission_local import LocalAdmission
from tenancy.admission_redis import RedisAdmission
from tenancy.keys import KeyHasher
from tenancy.redis_layout import RedisLayout
from tenancy.settings import TenancySettings
from tenancy.store_redis import RedisTenantStore


@pytest.fixture
def hasher() -> KeyHasher:
    return KeyHasher(TEST_SECRET.encode())


@pytest.fixture
def settings_factory(redis_url: str, redis_prefix: str) -> Callable[..., TenancySettings]:
    def build(**overrides: Any) -> TenancySettings:
        values: dict[str, Any] = {
            "store": "redis",
            "redis_url": redis_url,
            "key_prefix": redis_prefix,
            "secret": TEST_SECRET,
            "redis_probe_interval_s": 0.2,
            "resync_interval_s": 30.0,
            "redis_timeout_s": 2.0,  # a loaded 2-core machine must not flip admission into fail-static
        }
        values.update(overrides)
        return TenancySettings(**values)

    return build


@pytest.fixture
def settings(settings_factory: Callable[..., TenancySettings]) -> TenancySettings:
    return settings_factory()


@pytest.fixture
def store(settings: TenancySettings, hasher: KeyHasher) -> Iterator[RedisTenantStore]:
    s = RedisTenantStore(
        redis.Redis.from_url(settings.redis_url, socket_timeout=5),
        hasher,
        layout=RedisLayout(settings.key_prefix),
    )
    yield s
    s.close()


@pytest.fixture
async def enforcer_factory(
    settings_factory: Callable[..., TenancySettings],
) -> AsyncIterator[Callable[..., LocalAdmission | RedisAdmission]]:
    """Build a LocalAdmission or a RedisAdmission with the given settings overrides; closed afterwards."""
    made: list[LocalAdmission | RedisAdmission] = []

    def build(kind: str, **overrides: Any) -> LocalAdmission | RedisAdmission:
        s = settings_factory(**overrides)
        enforcer: LocalAdmission | RedisAdmission
        if kind == "local":
            enforcer = LocalAdmission(
                lease_ttl_s=s.lease_ttl_s,
                record_grace_s=s.record_grace_s,
                finished_ttl_s=s.finished_ttl_s,
                concurrency_retry_hint_s=s.concurrency_retry_hint_s,
            )
        else:
            enforcer = RedisAdmission.from_settings(s)
        made.append(enforcer)
        return enforcer

    yield build
    for enforcer in made:
        await enforcer.close()


@pytest.fixture(params=["local", "redis"])
def make_enforcer(request: pytest.FixtureRequest, enforcer_factory: Callable[..., Any]) -> Callable[..., Any]:
    """Parametrised over both implementations: the same behavioural test runs against each."""

    def build(**overrides: Any) -> LocalAdmission | RedisAdmission:
        return enforcer_factory(request.param, **overrides)

    build.kind = request.param  # type: ignore[attr-defined]
    return build
