"""The Redis tenant store, its audit trail, and the gateway cache kept in sync by pub/sub + resync."""

from __future__ import annotations

import asyncio
import logging

import pytest
from tenancy_testlib import TEST_SECRET, dump_prefix, eventually

from tenancy.directory import TenantDirectory
from tenancy.errors import (
    AuthenticationError,
    KeyNotFoundError,
    TenantExistsError,
    TenantNotFoundError,
)
from tenancy.models import Tenant, TenantStatus
from tenancy.watch_redis import RedisTenantWatcher


def test_tenant_crud_and_versions(store):
    created = store.create_tenant(Tenant(id="acme", display_name="Acme"), actor="alice")
    assert created.version >= 1 and created.created_at is not None
    with pytest.raises(TenantExistsError):
        store.create_tenant(Tenant(id="acme"), actor="alice")
    assert store.get_tenant("acme") == created

    updated = store.update_tenant("acme", {"quotas": {"max_concurrent": 2}}, actor="bob")
    assert updated.version > created.version and updated.quotas.max_concurrent == 2
    assert store.get_tenant("acme").quotas.max_concurrent == 2
    suspended = store.set_status("acme", TenantStatus.SUSPENDED, actor="bob")
    assert suspended.status is TenantStatus.SUSPENDED and suspended.version > updated.version
    store.create_tenant(Tenant(id="beta"), actor="alice")
    assert [t.id for t in store.list_tenants()] == ["acme", "beta"]

    store.delete_tenant("acme", actor="carol")
    with pytest.raises(TenantNotFoundError):
        store.get_tenant("acme")
    with pytest.raises(TenantNotFoundError):
        store.update_tenant("acme", {"weight": 2}, actor="bob")
    assert [t.id for t in store.list_tenants()] == ["beta"]


def test_update_retries_on_a_concurrent_change(store, monkeypatch):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    real_get = store.get_tenant
    stale = real_get("acme")
    calls = {"n": 0}

    def get_once_stale(tenant_id):
        calls["n"] += 1
        if calls["n"] == 1:
            return stale
        return real_get(tenant_id)

    # Another admin changes the tenant between our read and our write.
    store.update_tenant("acme", {"weight": 3}, actor="other")
    monkeypatch.setattr(store, "get_tenant", get_once_stale)
    result = store.update_tenant("acme", {"display_name": "Acme"}, actor="alice")
    assert calls["n"] == 2  # first attempt conflicted, second succeeded
    assert result.weight == 3 and result.display_name == "Acme"  # the other change was not lost


def test_keys_lifecycle(store):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    issued = store.create_key("acme", actor="alice", name="ci")
    listed = store.list_keys("acme")
    assert [k.key_id for k in listed] == [issued.key_id] and listed[0].name == "ci"
    revoked = store.revoke_key(issued.key_id, actor="alice")
    assert revoked.revoked_at is not None
    rotated_from = store.create_key("acme", actor="alice")
    new = store.rotate_key(rotated_from.key_id, actor="alice", grace_s=600)
    states = {k.key_id: k for k in store.list_keys("acme")}
    assert states[rotated_from.key_id].revoked_at is not None  # scheduled, in the future
    assert new.key_id in states
    with pytest.raises(KeyNotFoundError):
        store.revoke_key("0123456789abcdef", actor="alice")
    with pytest.raises(TenantNotFoundError):
        store.create_key("nobody", actor="alice")
    store.delete_tenant("acme", actor="alice")
    with pytest.raises(KeyNotFoundError):
        store.get_key(new.key_id)


def test_audit_trail_records_who_when_what(store):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    store.update_tenant("acme", {"quotas": {"requests_per_minute": 5}}, actor="bob")
    key = store.create_key("acme", actor="carol", name="ci")
    store.revoke_key(key.key_id, actor="dave")
    store.delete_tenant("acme", actor="erin")
    log = store.audit_log(10)
    assert [(e.action, e.actor) for e in log] == [
        ("tenant.delete", "erin"),
        ("key.revoke", "dave"),
        ("key.create", "carol"),
        ("tenant.update", "bob"),
        ("tenant.create", "alice"),
    ]
    assert log[3].changes == {"quotas.requests_per_minute": [60, 5]}
    assert log[2].key_id == key.key_id and log[2].changes["name"] == "ci"
    assert all(e.tenant_id == "acme" and e.at is not None for e in log)
    assert [e.version for e in log] == sorted((e.version for e in log), reverse=True)


async def _watcher(settings, hasher, **kwargs) -> tuple[RedisTenantWatcher, TenantDirectory]:
    directory = TenantDirectory(hasher)
    watcher = RedisTenantWatcher.from_settings(settings, directory)
    for name, value in kwargs.items():
        setattr(watcher, name, value)
    await watcher.start(require_initial=True)
    await watcher.wait_subscribed()
    return watcher, directory


async def test_cache_follows_admin_changes(store, settings, hasher):
    store.create_tenant(Tenant(id="early"), actor="alice")
    watcher, directory = await _watcher(settings, hasher)
    try:
        assert directory.get("early") is not None  # initial load
        store.create_tenant(Tenant(id="acme"), actor="alice")
        issued = store.create_key("acme", actor="alice")
        key = issued.plaintext.get_secret_value()
        await eventually(lambda: key_works(directory, key))
        store.set_status("acme", TenantStatus.SUSPENDED, actor="alice")
        await eventually(lambda: directory.get("acme").status is TenantStatus.SUSPENDED)
        store.revoke_key(issued.key_id, actor="alice")
        await eventually(lambda: not key_works(directory, key))
        store.delete_tenant("acme", actor="alice")
        await eventually(lambda: directory.get("acme") is None)
    finally:
        await watcher.stop()


def key_works(directory: TenantDirectory, key: str) -> bool:
    try:
        directory.authenticate(key)
    except AuthenticationError:
        return False
    return True


async def test_missed_announcement_is_healed_by_resync(store, settings, hasher):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    watcher, directory = await _watcher(settings, hasher)
    dropped = asyncio.Event()

    async def lose_message(data):  # the announcement is lost (pub/sub is at-most-once)
        dropped.set()

    watcher._on_message = lose_message  # type: ignore[method-assign]
    try:
        store.update_tenant("acme", {"weight": 7}, actor="alice")
        await asyncio.wait_for(dropped.wait(), 10)
        assert directory.get("acme").weight == 1.0  # stale: the message never arrived
        assert await watcher.resync() == 1
        assert directory.get("acme").weight == 7
        assert await watcher.resync() == 0  # nothing more to do: the revision matches
    finally:
        await watcher.stop()


async def test_periodic_resync_heals_without_any_message(store, settings, hasher):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    directory = TenantDirectory(hasher)
    watcher = RedisTenantWatcher.from_settings(
        settings.model_copy(update={"resync_interval_s": 0.1}), directory
    )

    async def lose_message(data):
        return None

    watcher._on_message = lose_message  # type: ignore[method-assign]
    await watcher.start(require_initial=True)
    try:
        store.update_tenant("acme", {"weight": 5}, actor="alice")
        await eventually(lambda: directory.get("acme").weight == 5)
    finally:
        await watcher.stop()


async def test_an_emptied_store_does_not_wipe_the_cache(store, settings, hasher, redis_client, caplog):
    store.create_tenant(Tenant(id="acme"), actor="alice")
    watcher, directory = await _watcher(settings, hasher)
    try:
        for key in redis_client.scan_iter(match=f"{settings.key_prefix}:*"):
            redis_client.delete(key)  # e.g. Redis restarted without persistence
        with caplog.at_level(logging.ERROR, logger="tenancy.watch_redis"):
            await watcher.resync()
        assert directory.get("acme") is not None
        assert "keeping the 1 cached tenants" in caplog.text
    finally:
        await watcher.stop()


async def test_no_plaintext_key_or_secret_in_redis_or_logs(store, settings, hasher, redis_client, caplog):
    caplog.set_level(logging.DEBUG)
    store.create_tenant(Tenant(id="acme"), actor="alice")
    watcher, directory = await _watcher(settings, hasher)
    try:
        issued = store.create_key("acme", actor="alice")
        rotated = store.rotate_key(issued.key_id, actor="alice", grace_s=60)
        plaintexts = [issued.plaintext.get_secret_value(), rotated.plaintext.get_secret_value()]
        await eventually(lambda: key_works(directory, plaintexts[1]))
        directory.authenticate(plaintexts[0])
        flipped = plaintexts[1][:-1] + ("1" if plaintexts[1].endswith("0") else "0")
        for bad in (plaintexts[0] + "x", flipped):
            with pytest.raises(AuthenticationError):
                directory.authenticate(bad)
    finally:
        await watcher.stop()
    needles = [p.encode() for p in plaintexts] + [p.split("_")[2].encode() for p in plaintexts]
    needles.append(TEST_SECRET.encode())
    dump = dump_prefix(redis_client, settings.key_prefix)
    assert dump and all(n not in dump for n in needles)
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert all(n.decode() not in text for n in needles)
