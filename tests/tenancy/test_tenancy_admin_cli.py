"""``loom admin`` end to end against Redis, through the CLI's main function."""

from __future__ import annotations

import json
import logging

import pytest
from tenancy_testlib import TEST_SECRET, dump_prefix

from loom import cmd_admin
from tenancy.directory import TenantCatalog, TenantDirectory
from tenancy.keys import KeyHasher
from tenancy.store_redis import RedisTenantStore


@pytest.fixture
def admin(redis_url, redis_prefix, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_TENANCY_SECRET", TEST_SECRET)

    def run(*argv: str, expect: int = 0):
        code = cmd_admin.main(
            [
                "--store",
                "redis",
                "--redis-url",
                redis_url,
                "--prefix",
                redis_prefix,
                "--actor",
                "tester",
                "--json",
                *argv,
            ]
        )
        out, err = capsys.readouterr()
        assert code == expect, (argv, out, err)
        return json.loads(out) if code == 0 and out.strip() else err

    return run


def test_admin_cli_kv_shares_and_slo_targets(admin):
    admin("tenant", "create", "acme", "--slo", "standard:ttft_ms=2000", "--slo", "batch:none")
    shared = admin("tenant", "update", "acme", "--kv-floor", "0.1", "--kv-cap", "0.5")
    assert (shared["kv_floor"], shared["kv_cap"]) == (0.1, 0.5)
    assert shared["speculative"] is False
    assert admin("tenant", "update", "acme", "--speculative")["speculative"] is True
    assert admin("tenant", "update", "acme", "--no-speculative")["speculative"] is False
    assert "kv_floor (0.9) is above kv_cap" in admin(
        "tenant", "update", "acme", "--kv-floor", "0.9", expect=1
    )
    slo = admin(
        "tenant", "update", "acme",
        "--slo", "interactive:ttft_ms=500,tpot_ms=50", "--slo", "batch:ttft_ms=60000,on_miss=queue",
    )  # fmt: skip
    assert slo["slo"] == {  # merged by class with what the tenant had
        "standard": {"ttft_ms": 2000.0, "tpot_ms": None, "on_miss": "refuse"},
        "interactive": {"ttft_ms": 500.0, "tpot_ms": 50.0, "on_miss": "refuse"},
        "batch": {"ttft_ms": 60000.0, "tpot_ms": None, "on_miss": "queue"},
    }
    assert set(admin("tenant", "update", "acme", "--slo", "batch:none")["slo"]) == {"interactive", "standard"}
    assert "slo.interactive.ttft_ms" in admin(
        "tenant", "update", "acme", "--slo", "interactive:ttft_ms=0", expect=1
    )
    with pytest.raises(SystemExit) as usage:  # argparse refuses an unknown class before any store call
        admin("tenant", "update", "acme", "--slo", "urgent:ttft_ms=5")
    assert usage.value.code == 2


def test_admin_cli_full_cycle(admin, settings, redis_client, caplog):
    caplog.set_level(logging.DEBUG)
    created = admin(
        "tenant",
        "create",
        "acme",
        "--name",
        "Acme",
        "--rpm",
        "100",
        "--tpm",
        "unlimited",
        "--models",
        "llama-*,smol*",
        "--priority-ceiling",
        "interactive",
    )
    assert created["quotas"]["requests_per_minute"] == 100 and created["quotas"]["tokens_per_minute"] is None
    assert created["allowed_models"] == ["llama-*", "smol*"] and created["priority_ceiling"] == "interactive"
    assert "already exists" in admin("tenant", "create", "acme", expect=1)
    assert "quotas.requests_per_minute" in admin("tenant", "create", "bad", "--rpm", "0", expect=1)
    assert [t["id"] for t in admin("tenant", "list")] == ["acme"]

    updated = admin("tenant", "update", "acme", "--max-concurrent", "3", "--weight", "2.5")
    assert updated["quotas"]["max_concurrent"] == 3 and updated["weight"] == 2.5
    assert updated["quotas"]["requests_per_minute"] == 100 and updated["version"] > created["version"]
    assert "nothing to update" in admin("tenant", "update", "acme", expect=1)

    issued = admin("key", "create", "acme", "--name", "ci", "--expires-in", "30d")
    plaintext = issued["key"]
    assert plaintext.startswith("loom_") and issued["state"] == "active" and issued["expires_at"]
    store = RedisTenantStore.from_settings(settings, KeyHasher(TEST_SECRET.encode()))
    directory = TenantDirectory(KeyHasher(TEST_SECRET.encode()), TenantCatalog.build(store.load_entries()))
    assert directory.authenticate(plaintext).tenant_id == "acme"

    listed = admin("key", "list", "acme")
    assert [k["key_id"] for k in listed] == [issued["key_id"]]
    assert "digest" not in listed[0] and plaintext not in json.dumps(listed)

    rotated = admin("key", "rotate", issued["key_id"], "--grace", "1h")
    assert rotated["replaces"] == issued["key_id"] and rotated["key"] != plaintext
    states = {k["key_id"]: k["state"] for k in admin("key", "list", "acme")}
    assert states == {issued["key_id"]: "revoking", rotated["key_id"]: "active"}
    assert admin("key", "revoke", issued["key_id"])["state"] == "revoked"

    assert admin("tenant", "suspend", "acme")["status"] == "suspended"
    assert admin("tenant", "activate", "acme")["status"] == "active"
    shown = admin("tenant", "show", "acme")
    assert shown["tenant"]["id"] == "acme" and len(shown["keys"]) == 2
    assert shown["quota_state"] == {"active_leases": 0, "day_tokens_used": 0, "month_tokens_used": 0}

    usage = admin("usage", "acme", "--days", "3")
    assert len(usage) == 3 and all(row["requests"] == 0 for row in usage)

    assert "without --yes" in admin("tenant", "delete", "acme", expect=1)
    admin("tenant", "delete", "acme", "--yes")
    assert admin("tenant", "list") == []
    assert "no tenant" in admin("tenant", "show", "acme", expect=1)

    audit = admin("audit", "--limit", "50")
    assert all(e["actor"] == "tester" and e["at"] for e in audit)
    assert [e["action"] for e in audit][::-1] == [
        "tenant.create",
        "tenant.update",
        "key.create",
        "key.rotate",
        "key.revoke",  # the rotation schedules the old key's revocation
        "key.revoke",
        "tenant.suspend",
        "tenant.activate",
        "tenant.delete",
    ]
    assert audit[-2]["changes"] == {"quotas.max_concurrent": [8, 3], "weight": [1.0, 2.5]}

    # the plaintext keys appear nowhere but in the one-time CLI output
    dump = dump_prefix(redis_client, settings.key_prefix)
    for key in (plaintext, rotated["key"]):
        assert key not in caplog.text and key.encode() not in dump
    store.close()


def test_admin_cli_reports_an_unreachable_store(monkeypatch, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("LOOM_TENANCY_SECRET", TEST_SECRET)
    code = cmd_admin.main(
        ["--store", "redis", "--redis-url", f"redis://127.0.0.1:{port}/0", "tenant", "list"]
    )
    assert code == cmd_admin.EXIT_UNAVAILABLE
    assert "unavailable" in capsys.readouterr().err


def test_admin_cli_on_the_file_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_TENANCY_SECRET", TEST_SECRET)
    base = ["--store", "file", "--tenants-file", str(tmp_path / "tenants.yaml"), "--actor", "tester"]
    assert cmd_admin.main([*base, "tenant", "create", "acme", "--rpm", "5"]) == 0
    assert cmd_admin.main([*base, "key", "create", "acme"]) == 0
    out = capsys.readouterr().out
    assert "loom_" in out and "tenant acme created" in out
    assert cmd_admin.main([*base, "tenant", "list"]) == 0
    assert "acme" in capsys.readouterr().out
    assert cmd_admin.main([*base, "usage", "acme"]) == 0


def test_duration_parsing():
    assert cmd_admin.parse_duration("90") == 90
    assert cmd_admin.parse_duration("10m") == 600
    assert cmd_admin.parse_duration("1.5h") == 5400
    assert cmd_admin.parse_duration("30d") == 30 * 86400
    with pytest.raises(Exception, match="invalid duration"):
        cmd_admin.parse_duration("soon")


def test_admin_registers_checks_lists_and_removes_adapters(admin, tmp_path):
    from loadtest.tiny_model import random_checkpoint, save_hf_dir, save_random_adapter

    ckpt = random_checkpoint()
    base = save_hf_dir(ckpt, tmp_path / "tiny")
    good = save_random_adapter(ckpt.config, tmp_path / "good", rank=4)
    admin("tenant", "create", "acme")
    added = admin("adapter", "add", "acme", "support", str(good), "--base-model", str(base))
    assert added["base_model"] == "tiny" and added["rank"] == 4 and len(added["digest"]) == 16
    listed = admin("adapter", "list", "acme")
    assert set(listed) == {"support"} and listed["support"]["path"] == str(good.resolve())
    # Refusals name what is wrong, and change nothing.
    err = admin("adapter", "add", "acme", "support", str(good), "--base-model", str(base), expect=1)
    assert "already has an adapter" in err
    wide = save_random_adapter(random_checkpoint(tiny_config_hidden(96)).config, tmp_path / "wide", rank=4)
    err = admin("adapter", "add", "acme", "wide", str(wide), "--base-model", str(base), expect=1)
    assert "does not fit this base model" in err
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text('{"r": 4}')
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00\x01garbage")
    err = admin("adapter", "add", "acme", "corrupt", str(corrupt), "--base-model", str(base), expect=1)
    assert "cannot read" in err
    err = admin("adapter", "add", "acme", "Bad:Name", str(good), "--base-model", str(base), expect=1)
    assert "adapters" in err
    assert set(admin("adapter", "list", "acme")) == {"support"}
    admin("adapter", "remove", "acme", "support")
    assert admin("adapter", "list", "acme") == {}
    actions = [e["changes"] for e in admin("audit") if e.get("tenant_id") == "acme"]
    assert any("adapters" in c for c in actions)  # every change is in the audit trail


def tiny_config_hidden(hidden: int):
    from loadtest.tiny_model import tiny_config

    return tiny_config(hidden_size=hidden, intermediate_size=2 * hidden)
