"""The gateway's TLS certificate, reloaded from its files while the gateway runs.

cert-manager renews a certificate before it expires and rewrites its Secret; the kubelet then swaps
the mounted files (one symlink flip for the certificate, the key and the CA together). A gateway that
read its certificate only at start would keep serving the old one until it expires, so the gateway
polls the files and, once they hold a new, valid pair, serves it to every new connection: gRPC through
gRPC's dynamic server credentials (asked for the current certificate at each handshake), HTTP by
loading the pair into the front's live SSL context. Connections already open keep the certificate
they shook hands with.

A half-written update (a certificate whose key has not landed yet, a file being rewritten) is never
served: the pair is checked by loading it into an SSL context, and the files must not change while
they are read; otherwise the old certificate stays and the next poll tries again.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from prometheus_client import Counter, Gauge

log = logging.getLogger(__name__)

RELOADS = Counter(
    "loom:gateway_tls_reloads",
    "Certificate files that changed on disk, by outcome: loaded (now served) or rejected (the old stays).",
    ["outcome"],
)
EXPIRY = Gauge(
    "loom:gateway_tls_certificate_expiry_timestamp_seconds",
    "When the served certificate expires (Unix time): alert well before it, in case renewal fails.",
)

_Signature = tuple[tuple[int, int, int, int] | None, ...]


class CertificateError(OSError):
    """The files do not hold a usable certificate and key (unreadable, malformed or not a pair)."""


@dataclass(frozen=True)
class TlsMaterial:
    key: bytes
    cert: bytes
    client_ca: bytes | None
    not_after: float  # the certificate's expiry, Unix seconds


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def _paths(self) -> list[tuple[str, str]]:
        named = [(self.key_file, "key"), (self.cert_file, "certificate")]
        return named + ([(self.client_ca_file, "client CA")] if self.client_ca_file else [])

    def signature(self) -> _Signature:
        """What identifies the files' current contents without reading them (stat follows the
        kubelet's symlinks, so a swap shows as a new inode)."""
        out: list[tuple[int, int, int, int] | None] = []
        for path, _ in self._paths():
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)

    def load(self) -> TlsMaterial:
        """The files' certificate, checked to be a pair; raises CertificateError naming what is wrong."""
        before = self.signature()
        contents = []
        for path, what in self._paths():
            try:
                with open(path, "rb") as f:
                    contents.append(f.read())
            except OSError as exc:
                raise CertificateError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)
            not_after = x509.load_pem_x509_certificate(contents[1]).not_valid_after_utc.timestamp()
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise CertificateError(
                f"{self.cert_file} and {self.key_file} are not a usable pair: {exc}"
            ) from None
        if self.signature() != before:
            raise CertificateError(f"{self.cert_file} or its key changed while being read")
        return TlsMaterial(contents[0], contents[1], contents[2] if self.client_ca_file else None, not_after)


class CertificateReloader:
    """The certificate being served, and a poll that swaps in a new one when the files change.

    ``check`` runs on the gateway's event loop (a few stats per poll); the gRPC fetcher runs on
    gRPC's own threads and only reads what ``check`` published.
    """

    def __init__(self, files: TlsFiles, on_reload: Callable[[TlsFiles], None] | None = None) -> None:
        self.files = files
        self._signature = files.signature()
        self.material = files.load()  # at start an unusable certificate stops the gateway
        self._handed: TlsMaterial | None = self.material  # what gRPC was last given
        self._rejected: _Signature | None = None
        self.on_reload = on_reload
        EXPIRY.set(self.material.not_after)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_config(self.material),
            self._fetch,
            require_client_authentication=self.material.client_ca is not None,
        )

    @staticmethod
    def _grpc_config(m: TlsMaterial) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(m.key, m.cert)], root_certificates=m.client_ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks at each handshake: a new configuration once after a reload, else None (keep)."""
        current = self.material
        if current is self._handed:
            return None
        self._handed = current
        return self._grpc_config(current)

    def check(self) -> bool:
        """Load the files if they changed since the last load; whether a new certificate is served."""
        signature = self.files.signature()
        if signature == self._signature or signature == self._rejected:
            return False
        try:
            material = self.files.load()
            if self.on_reload is not None:
                self.on_reload(self.files)
        except (ssl.SSLError, OSError) as exc:  # CertificateError included
            RELOADS.labels("rejected").inc()
            self._rejected = signature
            log.warning(
                "TLS files changed but were not loaded, still serving the previous certificate: %s", exc
            )
            return False
        self.material = material
        self._signature = signature
        self._rejected = None
        RELOADS.labels("loaded").inc()
        EXPIRY.set(material.not_after)
        log.info("TLS certificate reloaded from %s", self.files.cert_file)
        return True
