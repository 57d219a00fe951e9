"""The grpc.aio server: Inference + health + reflection, optional TLS/mTLS, metrics, graceful drain.

The same class runs inside ``loom serve`` and inside a Ray Serve replica (serving/ingress.py): one code
path however the gateway is deployed. It owns the :class:`RequestPath` that both fronts adapt
(gateway/grpc/, gateway/http/), so every rule is the same whichever front a client calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc_health.v1 import health

from gateway.catalog import ModelCatalog
from gateway.grpc.server import build_server, set_health
from gateway.http.server import HttpFront
from gateway.loop_lag import watch_loop_lag
from gateway.metrics import ENGINE, ReplicaRow, start_metrics_server
from gateway.request_path import RequestPath
from gateway.settings import GatewaySettings
from gateway.tls import CertificateReloader, TlsFiles
from tenancy import Tenancy

log = logging.getLogger(__name__)


class GatewayServer:
    def __init__(self, settings: GatewaySettings, tenancy: Tenancy, catalog: ModelCatalog) -> None:
        self.settings = settings
        self.tenancy = tenancy
        self.catalog = catalog
        self.path = RequestPath(tenancy, catalog, settings)
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_server: Any = None
        self.tls: CertificateReloader | None = None
        self._tls_watch: asyncio.Task[None] | None = None
        self._lag_watch: asyncio.Task[None] | None = None
        self.http = HttpFront(
            self.path, settings, serving=lambda: self._server is not None and not self.path.draining
        )

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI-compatible HTTP front, when it runs."""
        return f"{self.settings.host}:{self.http.port}" if self.http.port is not None else None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_server.server_port if self._metrics_server is not None else None

    def _replica_rows(self) -> list[ReplicaRow]:
        return [
            (r.pool.name, r.model, replica, stats)
            for r in self.catalog.routes
            for replica, stats in r.pool.replica_stats().items()
        ]

    async def start(self) -> GatewayServer:
        s = self.settings
        server = build_server(self.path, s, self._health)
        target = f"{s.host}:{s.port}"
        try:
            if s.tls_cert_file and s.tls_key_file:
                files = TlsFiles(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
                self.tls = CertificateReloader(files, on_reload=self.http.use_certificate)
                self.port = server.add_secure_port(target, self.tls.grpc_credentials())
            else:
                self.port = server.add_insecure_port(target)
        except RuntimeError:  # grpc's word for a bind that failed
            self.port = 0
        if not self.port:
            shared = "" if s.reuse_port else " (another gateway shares it only with reuse_port set)"
            raise OSError(f"cannot listen on {target}: the address is in use or not this host's{shared}")
        if s.metrics_port is not None:
            self._metrics_server = start_metrics_server(s.metrics_host, s.metrics_port)
        try:
            await server.start()
            self._server = server
            self.path.constraints.warm(r.tokenizer for r in self.catalog.routes)
            if s.http_port is not None:
                await self.http.start(s.host, s.http_port)
            await set_health(self._health, serving=True)
            if self.tls is not None and s.tls_reload_interval_s > 0:
                self._tls_watch = asyncio.create_task(self._watch_tls(s.tls_reload_interval_s))
            self._lag_watch = asyncio.create_task(watch_loop_lag())
        except BaseException:
            await server.stop(0)
            self._server = None
            await self.http.stop()
            self._stop_metrics()
            raise
        ENGINE.add_source(id(self), self._replica_rows)
        security = ("mTLS" if s.tls_client_ca_file else "TLS") if s.tls else "plaintext"
        log.info("gateway listening on %s (gRPC, %s)", self.address, security)
        if self.http_address is not None:
            log.info("OpenAI-compatible HTTP on %s (%s)", self.http_address, security)
        return self

    async def _watch_tls(self, interval_s: float) -> None:
        """Serve a renewed certificate without a restart (gateway/tls.py)."""
        assert self.tls is not None
        while True:
            await asyncio.sleep(interval_s)
            self.tls.check()

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let streams finish up to the grace period."""
        if self._server is None:
            return
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self.path.draining = True
        await set_health(self._health, serving=False)
        log.info("gateway draining (grace %.0f s)", grace)
        # Refuse new calls ourselves first (UNAVAILABLE, retryable) while clients see NOT_SERVING and
        # move away: once the listeners close, gRPC cancels a call that raced the close (CANCELLED,
        # which clients do not retry).
        refuse = min(self.settings.drain_refuse_s, grace)
        await asyncio.sleep(refuse)
        await asyncio.gather(self._server.stop(grace - refuse), self.http.stop())
        self._server = None
        for route in self.catalog.routes:  # their background streams, while their transport is up
            await route.pool.close()
        for task in (self._tls_watch, self._lag_watch):
            if task is not None:
                task.cancel()
        self._tls_watch = self._lag_watch = None
        ENGINE.remove_source(id(self))
        self._stop_metrics()
