"""API keys: format, keyed hashing, authentication refusals that are indistinguishable."""

from __future__ import annotations

import hmac as real_hmac
import os
import stat
from datetime import timedelta

import pytest

import tenancy.keys as keys_module
from tenancy.directory import TenantCatalog, TenantDirectory, TenantEntry
from tenancy.errors import AuthenticationError
from tenancy.keys import KeyHasher, generate_key, load_or_create_secret, parse_key_id, strip_bearer
from tenancy.models import Tenant, utcnow


def _directory(hasher: KeyHasher, *entries: TenantEntry) -> TenantDirectory:
    return TenantDirectory(hasher, TenantCatalog.build(entries))


def test_key_format_and_parsing():
    key_id, key = generate_key()
    assert key.startswith(f"loom_{key_id}_") and len(key) == 5 + 16 + 1 + 48
    assert parse_key_id(key) == key_id
    for bad in ("", "loom_", "Bearer x", key + "0", key.upper(), key.replace("_", "-"), None, 42):
        assert parse_key_id(bad) is None  # type: ignore[arg-type]
    assert strip_bearer(f"Bearer {key}") == key and strip_bearer(f"bearer  {key} ") == key
    assert generate_key()[1] != generate_key()[1]


def test_digest_is_keyed(hasher):
    _, key = generate_key()
    other = KeyHasher(b"another-server-secret-0123456789")
    assert hasher.digest(key) != other.digest(key)
    assert len(hasher.digest(key)) == 64
    issued = hasher.issue("acme", name="ci")
    assert issued.record.digest == hasher.digest(issued.plaintext.get_secret_value())
    assert issued.plaintext.get_secret_value() not in repr(issued)
    assert issued.plaintext.get_secret_value() not in issued.record.model_dump_json()


def test_secret_rotation_keeps_old_keys_valid(hasher):
    tenant = Tenant(id="acme")
    old_key = hasher.issue("acme")
    rotated = KeyHasher(
        b"the-new-server-secret-0123456789", previous=[b"test-server-secret-0123456789abcdef"]
    )
    new_key = rotated.issue("acme")
    directory = _directory(rotated, TenantEntry(tenant, (old_key.record, new_key.record)))
    for issued in (old_key, new_key):
        assert directory.authenticate(issued.plaintext.get_secret_value()).tenant_id == "acme"


def test_refusals_are_identical_and_do_the_same_work(hasher, monkeypatch):
    """Unknown, malformed, tampered, revoked, expired, deleted-tenant: same error, same work."""
    now = utcnow()
    tenant = Tenant(id="acme")
    good = hasher.issue("acme")
    revoked = hasher.issue("acme")
    expired = hasher.issue("acme")
    orphan = hasher.issue("gone")
    records = (
        good.record,
        revoked.record.model_copy(update={"revoked_at": now - timedelta(seconds=1)}),
        expired.record.model_copy(update={"expires_at": now - timedelta(seconds=1)}),
    )
    directory = _directory(hasher, TenantEntry(tenant, records))
    good_key = good.plaintext.get_secret_value()
    assert directory.authenticate(good_key).tenant_id == "acme"
    assert directory.authenticate(f"Bearer {good_key}").key_id == good.key_id

    _, unknown = generate_key()
    tampered = good_key[:-1] + ("0" if good_key[-1] != "0" else "1")
    candidates = {
        "unknown": unknown,
        "malformed": "not-a-key",
        "empty": "",
        "tampered": tampered,
        "revoked": revoked.plaintext.get_secret_value(),
        "expired": expired.plaintext.get_secret_value(),
        "deleted tenant": orphan.plaintext.get_secret_value(),
    }
    calls = {"digest": 0, "compare": 0}
    real_new, real_compare = real_hmac.new, real_hmac.compare_digest

    def counting_compare(a, b):
        calls["compare"] += 1
        return real_compare(a, b)

    def counting_new(*args, **kwargs):
        calls["digest"] += 1
        return real_new(*args, **kwargs)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting_compare)
    monkeypatch.setattr(keys_module.hmac, "new", counting_new)
    errors = []
    for name, token in candidates.items():
        calls.update(digest=0, compare=0)
        with pytest.raises(AuthenticationError) as info:
            directory.authenticate(token)
        assert calls == {"digest": 1, "compare": 1}, name
        errors.append((type(info.value), str(info.value), info.value.args))
    assert len(set(errors)) == 1
    assert errors[0] == (AuthenticationError, "invalid API key", ("invalid API key",))
    # the same count on success: a valid key is not distinguishable by the work done either
    calls.update(digest=0, compare=0)
    directory.authenticate(good_key)
    assert calls == {"digest": 1, "compare": 1}


def test_rotation_overlap(hasher):
    now = utcnow()
    tenant = Tenant(id="acme")
    old = hasher.issue("acme")
    scheduled = old.record.model_copy(update={"revoked_at": now + timedelta(hours=1)})
    directory = _directory(hasher, TenantEntry(tenant, (scheduled,)))
    key = old.plaintext.get_secret_value()
    assert directory.authenticate(key, now=now).tenant_id == "acme"
    assert scheduled.state_at(now) == "revoking"
    with pytest.raises(AuthenticationError):
        directory.authenticate(key, now=now + timedelta(hours=2))


def test_secret_file_is_created_private(tmp_path):
    path = tmp_path / "sub" / "secret"
    first = load_or_create_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_secret(path) == first and len(first) >= 32


def test_prefix_cache_salt_is_per_tenant_and_secret(hasher):
    assert hasher.derive("salt", "a") == hasher.derive("salt", "a")
    assert hasher.derive("salt", "a") != hasher.derive("salt", "b")
    assert KeyHasher(b"x" * 32).derive("salt", "a") != hasher.derive("salt", "a")
