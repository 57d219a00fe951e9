"""The embedded file store: bootstrap with a demo tenant, hand edits, hot reload, the runtime."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml
from tenancy_testlib import eventually, rid

from tenancy.admission import QuotaMode
from tenancy.directory import TenantDirectory
from tenancy.errors import AuthenticationError, TenantExistsError, TenantValidationError
from tenancy.models import Tenant, TenantStatus
from tenancy.runtime import Tenancy, bootstrap_embedded
from tenancy.settings import TenancySettings
from tenancy.store_file import FileTenantStore, audit_path_for, ensure_default_tenants_file
from tenancy.watch_file import FileTenantWatcher


def test_bootstrap_creates_a_demo_tenant_once(tmp_path: Path, hasher):
    path = tmp_path / "loom" / "tenants.yaml"
    key = ensure_default_tenants_file(path, hasher)
    assert key is not None and key.startswith("loom_")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert key not in text and key.split("_")[2] not in text  # only the keyed hash is stored
    assert ensure_default_tenants_file(path, hasher) is None  # never overwritten
    directory = TenantDirectory(hasher)
    FileTenantWatcher(path, directory).reload(strict=True)
    assert directory.authenticate(key).tenant_id == "demo"


def test_bootstrap_from_settings_generates_the_secret_file(tmp_path: Path):
    settings = TenancySettings(tenants_file=tmp_path / "tenants.yaml", secret_file=tmp_path / "secret")
    key = bootstrap_embedded(settings)
    assert key is not None
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert bootstrap_embedded(settings.model_copy(update={"store": "redis"})) is None


def test_admin_operations_on_the_file(tmp_path: Path, hasher):
    store = FileTenantStore(tmp_path / "tenants.yaml", hasher)
    store.create_tenant(Tenant(id="acme"), actor="alice")
    with pytest.raises(TenantExistsError):
        store.create_tenant(Tenant(id="acme"), actor="alice")
    issued = store.create_key("acme", actor="alice", name="ci")
    store.update_tenant("acme", {"quotas": {"requests_per_minute": 5}}, actor="bob")
    store.set_status("acme", TenantStatus.SUSPENDED, actor="bob")
    assert store.get_tenant("acme").quotas.requests_per_minute == 5
    assert store.get_tenant("acme").status is TenantStatus.SUSPENDED
    assert [k.key_id for k in store.list_keys("acme")] == [issued.key_id]
    store.revoke_key(issued.key_id, actor="carol")
    assert store.list_keys("acme")[0].revoked_at is not None
    actions = [e.action for e in store.audit_log()]
    assert actions == ["key.revoke", "tenant.suspend", "tenant.update", "key.create", "tenant.create"]
    assert issued.plaintext.get_secret_value() not in audit_path_for(store.path).read_text()
    store.delete_tenant("acme", actor="carol")
    assert store.list_tenants() == []


async def test_watcher_reloads_edits_and_keeps_config_on_a_bad_edit(tmp_path: Path, hasher, caplog):
    path = tmp_path / "tenants.yaml"
    key = ensure_default_tenants_file(path, hasher)
    directory = TenantDirectory(hasher)
    watcher = FileTenantWatcher(path, directory, poll_interval_s=0.05)
    await watcher.start()
    try:
        assert directory.get("demo").quotas.max_concurrent == 8
        doc = yaml.safe_load(path.read_text())
        doc["tenants"][0]["quotas"]["max_concurrent"] = 2
        path.write_text(yaml.safe_dump(doc))  # a hand edit
        assert watcher.reload()
        assert directory.get("demo").quotas.max_concurrent == 2

        doc["tenants"][0]["quotas"]["max_concurrent"] = -5
        path.write_text(yaml.safe_dump(doc) + "\n# broken\n")
        assert not watcher.reload()
        assert directory.get("demo").quotas.max_concurrent == 2  # previous config stays
        assert "keeping the previous tenants" in caplog.text and "quotas.max_concurrent" in caplog.text
        assert directory.authenticate(key).tenant_id == "demo"

        with pytest.raises(TenantValidationError):  # admin writes refuse to build on a broken file
            FileTenantStore(path, hasher).create_tenant(Tenant(id="beta"), actor="x")
        doc["tenants"][0]["quotas"]["max_concurrent"] = 3
        path.write_text(yaml.safe_dump(doc))
        FileTenantStore(path, hasher).create_tenant(Tenant(id="beta"), actor="x")  # the poller sees it

        async def has_beta() -> bool:
            return directory.get("beta") is not None

        await eventually(has_beta)
    finally:
        await watcher.stop()


def test_invalid_file_at_start_fails_fast(tmp_path: Path, hasher):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - id: Not Valid\n")
    with pytest.raises(TenantValidationError, match="tenants\\[0\\]"):
        FileTenantWatcher(path, TenantDirectory(hasher)).reload(strict=True)


async def test_embedded_runtime_end_to_end(tmp_path: Path):
    settings = TenancySettings(
        store="file", tenants_file=tmp_path / "tenants.yaml", secret_file=tmp_path / "secret"
    )
    key = bootstrap_embedded(settings)
    tenancy = Tenancy.from_settings(settings)
    await tenancy.start()
    try:
        principal = tenancy.authenticate(f"Bearer {key}")
        with pytest.raises(AuthenticationError):
            tenancy.authenticate("Bearer nope")
        tenant = principal.tenant
        tenancy.check_request(tenant, model="smollm2-135m", prompt_tokens=10, max_tokens=20)
        assert tenancy.quota_mode is QuotaMode.LOCAL
        admission = await tenancy.admission.admit(tenant, rid(), 10, 20)
        async with tenancy.admission.hold(tenant, admission) as lease:
            lease.completion_tokens = 5
        assert len(tenancy.prefix_cache_salt("demo")) == 32
    finally:
        await tenancy.stop()
    usage = FileTenantStore(settings.tenants_file, settings.hasher()).usage("demo", 1)[-1]
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (1, 10, 5)
    # a restarted server continues from the persisted usage
    again = Tenancy.from_settings(settings)
    await again.start()
    try:
        assert again.admission.usage("demo", 1)[-1].requests == 1
    finally:
        await again.stop()
