"""API keys: generation, parsing, keyed hashing and the server secret.

Format: ``loom_<key id: 16 hex>_<secret: 48 hex>``. The ``loom_`` prefix makes leaked keys easy to
spot for secret scanners; the key id is the lookup handle (not secret, shown in listings and logs);
the 192-bit secret part never leaves the caller. Stores hold ``HMAC-SHA256(server secret, key)`` only,
so a dump of Redis or of the tenants file cannot be used to authenticate, and a stolen hash cannot be
brute-forced without the server secret either.

Verification always does the same work, whether or not the key id exists or the token is even well
formed: one HMAC and one :func:`hmac.compare_digest` against either the stored digest or a dummy. That
keeps the refusal time independent of which check failed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pydantic import SecretStr

from tenancy.errors import TenancyError
from tenancy.models import ApiKey, IssuedKey, utcnow, validate_tenant_id

log = logging.getLogger(__name__)

KEY_PREFIX = "loom"
KEY_ID_HEX = 16
SECRET_HEX = 48
_KEY_RE = re.compile(rf"^{KEY_PREFIX}_([0-9a-f]{{{KEY_ID_HEX}}})_([0-9a-f]{{{SECRET_HEX}}})$")
_MIN_SECRET_BYTES = 16


def generate_key() -> tuple[str, str]:
    """A new ``(key_id, plaintext key)`` pair from the OS CSPRNG."""
    key_id = secrets.token_hex(KEY_ID_HEX // 2)
    secret = secrets.token_hex(SECRET_HEX // 2)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secret}"


def parse_key_id(token: str) -> str | None:
    """The key id of a well-formed key, else ``None``. Never raises, whatever ``token`` is."""
    if not isinstance(token, str):
        return None
    match = _KEY_RE.match(token)
    return match.group(1) if match else None


def strip_bearer(value: str) -> str:
    """``"Bearer abc"`` -> ``"abc"`` (scheme case-insensitive); anything else is returned stripped."""
    value = value.strip()
    scheme, _, rest = value.partition(" ")
    if rest and scheme.lower() == "bearer":
        return rest.strip()
    return value


def secret_fingerprint(secret: bytes) -> str:
    """A short public id for a server secret, so a key record says which secret hashed it."""
    return hmac.new(secret, b"loom-secret-id", hashlib.sha256).hexdigest()[:12]


class KeyHasher:
    """Keyed hashing of API keys with the server secret (and older secrets while rotating it).

    Rotating the server secret: put the new one first and the old one in ``previous``; existing keys
    keep verifying (their record names the secret that hashed them), new keys use the new secret.
    """

    def __init__(self, secret: bytes, previous: Sequence[bytes] = ()) -> None:
        for s in (secret, *previous):
            if len(s) < _MIN_SECRET_BYTES:
                raise TenancyError(f"server secret must be at least {_MIN_SECRET_BYTES} bytes")
        self._current = secret
        self._current_id = secret_fingerprint(secret)
        self._by_id = {secret_fingerprint(s): s for s in (*previous, secret)}
        # Compared against when a key id is unknown, so that path costs the same as a known one.
        self._dummy_digest = hmac.new(secret, b"loom-dummy-key", hashlib.sha256).hexdigest()

    @property
    def secret_id(self) -> str:
        return self._current_id

    @property
    def dummy_digest(self) -> str:
        return self._dummy_digest

    def digest(self, plaintext: str, secret_id: str | None = None) -> str:
        secret = self._by_id.get(secret_id or self._current_id, self._current)
        return hmac.new(secret, plaintext.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def verify(self, plaintext: str, expected_digest: str, secret_id: str) -> bool:
        """Constant-time comparison of the key's keyed hash with ``expected_digest``."""
        return hmac.compare_digest(self.digest(plaintext, secret_id), expected_digest)

    def derive(self, label: str, data: str) -> bytes:
        """A stable per-purpose secret value, e.g. the gateway's per-tenant prefix-cache salt."""
        return hmac.new(self._current, f"{label}\x00{data}".encode(), hashlib.sha256).digest()

    def issue(
        self,
        tenant_id: str,
        *,
        name: str = "",
        created_by: str = "",
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> IssuedKey:
        """Make a new key for ``tenant_id``: the record to store and the plaintext to show once."""
        validate_tenant_id(tenant_id)
        now = now or utcnow()
        if expires_at is not None and expires_at <= now:
            raise TenancyError("expires_at must be in the future")
        key_id, plaintext = generate_key()
        record = ApiKey(
            key_id=key_id,
            tenant_id=tenant_id,
            digest=self.digest(plaintext),
            secret_id=self._current_id,
            name=name,
            created_at=now,
            created_by=created_by,
            expires_at=expires_at,
        )
        return IssuedKey(record=record, plaintext=SecretStr(plaintext))


def load_or_create_secret(path: Path) -> bytes:
    """Read the server secret from ``path``, creating it (random, mode 0600) if it does not exist.

    Meant for single-node and development use; a cluster passes the same secret to every replica
    through settings (an env var fed from a Kubernetes Secret) instead.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process created it first: read theirs
        else:
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32) + "\n")
            log.info("created a new server secret file at %s (mode 0600)", path)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("server secret file %s is readable by others (mode %o); chmod 600 it", path, mode)
    value = path.read_text().strip()
    if len(value) < _MIN_SECRET_BYTES:
        raise TenancyError(f"server secret in {path} is too short (need at least {_MIN_SECRET_BYTES} chars)")
    return value.encode()
