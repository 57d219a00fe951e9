"""Bounds on the HTTP front's connections, so that clients that connect and never finish cannot hold
the gateway's sockets and memory: a cap on open connections, in all and per source address, and a
deadline for a request's headers (the body's is in gateway/http/body.py).

uvicorn has neither a header deadline nor a connection cap (its ``limit_concurrency`` answers 503 to
a request whose headers are complete, which a client that never completes them never reaches), so its
protocol is extended here; the parsing and the application call are uvicorn's own.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _plain_reply(status: str, text: str) -> bytes:
    """A whole response to write before closing: the client learns why, not only that."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    return f"{head}content-length: {len(text)}\r\n\r\n{text}".encode()


_TOO_MANY = _plain_reply("503 Service Unavailable", "too many connections; retry in a while")
_TOO_SLOW = _plain_reply("408 Request Timeout", "the request's headers came too slowly")


@dataclass
class ConnectionLimits:
    """The front's open connections, counted by source address; shared by all its protocol objects."""

    max_connections: int
    max_per_source: int
    header_timeout_s: float
    open: Counter[str] = field(default_factory=Counter)
    refused: int = 0  # connections closed at once for a cap
    timed_out: int = 0  # connections closed for headers that did not arrive in time

    def admit(self, source: str) -> bool:
        if sum(self.open.values()) >= self.max_connections or self.open[source] >= self.max_per_source:
            self.refused += 1
            return False
        self.open[source] += 1
        return True

    def release(self, source: str) -> None:
        self.open[source] -= 1
        if self.open[source] <= 0:
            del self.open[source]


def bounded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP/1.1 protocol under ``limits``."""

    class BoundedHttp(HttpToolsProtocol):
        _source: str | None = None
        _headers_due: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            source = self.client[0] if self.client else "unknown"
            if not limits.admit(source):
                transport.write(_TOO_MANY)
                transport.close()
                return
            self._source = source
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a keep-alive connection's next request: its headers are due again

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._source is not None:
                limits.release(self._source)
                self._source = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._headers_due is None:
                self._headers_due = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
                self._headers_due = None

        def _headers_late(self) -> None:
            self._headers_due = None
            limits.timed_out += 1
            if not self.transport.is_closing():
                self.transport.write(_TOO_SLOW)
                self.transport.close()

    return BoundedHttp
