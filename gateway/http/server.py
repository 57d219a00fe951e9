"""The uvicorn server that serves the HTTP front in the gateway's event loop, and its TLS renewal."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
from collections.abc import Callable, Iterator

import uvicorn

from gateway.http.app import build_app
from gateway.http.connections import ConnectionLimits, bounded_protocol
from gateway.request_path import RequestPath
from gateway.settings import GatewaySettings
from gateway.tls import TlsFiles


class HttpFront:
    def __init__(self, path: RequestPath, settings: GatewaySettings, serving: Callable[[], bool]) -> None:
        self.settings = settings
        self.app = build_app(path, serving)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None
        self.connections = ConnectionLimits(
            settings.http_max_connections,
            settings.http_max_connections_per_source,
            settings.http_header_timeout_s,
        )

    async def start(self, host: str, port: int) -> int:
        s = self.settings
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            lifespan="off",
            http=bounded_protocol(self.connections),
            log_level="warning",
            access_log=False,
            timeout_keep_alive=math.ceil(s.http_keepalive_s),
            timeout_graceful_shutdown=max(1, math.ceil(s.drain_grace_s)),
            ssl_certfile=s.tls_cert_file,
            ssl_keyfile=s.tls_key_file,
            ssl_ca_certs=s.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_REQUIRED if s.tls_client_ca_file else ssl.CERT_NONE,
        )
        server = _QuietServer(config)
        # Bound here, not by uvicorn: a port in use is an OSError raised to the caller, where uvicorn
        # would call sys.exit, which ends the event loop it runs on (in a Serve replica, the loop
        # of its constructor, which then never returns).
        sockets = [_listening_socket(host, port, s.reuse_port)]
        self._task = asyncio.create_task(server.serve(sockets=sockets))
        while not server.started:
            if self._task.done():
                await self._task  # raises what stopped it (a port in use...)
                raise OSError(f"the HTTP front did not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self._server = server
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self.port

    def use_certificate(self, files: TlsFiles) -> None:
        """Serve a renewed certificate to new connections (gateway/tls.py). A new client CA is added
        beside the old one: Python's SSL context cannot forget a CA, so dropping one needs a restart."""
        context = self._server.config.ssl if self._server is not None else None
        if context is None:
            return
        context.load_cert_chain(files.cert_file, files.key_file)
        if files.client_ca_file:
            context.load_verify_locations(files.client_ca_file)

    async def stop(self) -> None:
        """Stop accepting; streams in flight get up to the drain grace to finish."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
        self._server = None


def _listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The front's listening socket; with ``reuse_port``, one other gateway processes on this host
    may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _QuietServer(uvicorn.Server):
    """The host process owns the signals (the gateway drains on them): uvicorn installs none."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
