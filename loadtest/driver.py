"""How the load generator talks to a front: one small interface, one gRPC implementation.

The runner only needs "stream this request, tell me each chunk's token count as it arrives, or
raise with a status code", so that is the whole interface (:class:`Driver`). The gRPC driver wraps
``gateway.client.LoomClient``; an HTTP driver for the OpenAI-compatible front, when it exists,
implements the same two methods (map HTTP 429 to ``RESOURCE_EXHAUSTED``, 401 to
``UNAUTHENTICATED``, and so on, so reports stay comparable across fronts).

Only loopback targets are accepted: a load generator pointed at someone else's server by a typo is
a denial-of-service tool, and this one is meant for the machine it runs on.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import grpc

from common import Priority
from gateway.api import pb
from gateway.client import LoomClient


class NotLoopbackError(ValueError):
    """A target outside this machine."""


def _is_loopback_host(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost: resolving it could lead anywhere


def require_loopback(address: str) -> str:
    """``host:port`` (``[::1]:port``, ``unix:/path``) on this machine, or NotLoopbackError."""
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise NotLoopbackError(f"{address!r} is not host:port")
    if not _is_loopback_host(host):
        raise NotLoopbackError(
            f"refusing to load {address}: the load generator only targets this machine "
            "(127.0.0.0/8, ::1, localhost or a unix socket)"
        )
    return address


def require_loopback_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise NotLoopbackError(f"{url!r} is not an http(s) URL")
    if not _is_loopback_host(parts.hostname):
        raise NotLoopbackError(f"refusing to scrape {url}: metrics are read from this machine only")
    return url


@dataclass(frozen=True)
class DriverRequest:
    """A front-neutral completion request."""

    request_id: str
    tenant: str
    model: str
    prompt: str
    chat: bool
    max_tokens: int
    temperature: float
    priority: Priority | None
    seed: int | None
    timeout_s: float


@dataclass(frozen=True)
class Chunk:
    """One streamed message: how many tokens it carried; the last one says why and how many in all."""

    tokens: int
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class DriverError(Exception):
    """The call ended with a status other than OK; ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Driver(Protocol):
    name: str

    def stream(self, request: DriverRequest) -> AsyncIterator[Chunk]:
        """Chunks as they arrive; raises DriverError for a non-OK end. Closing it cancels the call."""
        ...

    async def close(self) -> None: ...


class GrpcDriver:
    """``loom.v1.Inference/Generate`` through one LoomClient (one channel) per tenant key."""

    name = "grpc"

    def __init__(self, address: str, keys: dict[str, str]) -> None:
        self.address = require_loopback(address)
        self.clients = {tenant: LoomClient(address, key) for tenant, key in keys.items()}

    async def stream(self, request: DriverRequest) -> AsyncIterator[Chunk]:
        msg = pb.GenerateRequest(
            model=request.model,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            request_id=request.request_id,
            priority=_PB_PRIORITY[request.priority],
        )
        if request.chat:
            msg.messages.add(role="user", content=request.prompt)
        else:
            msg.prompt = request.prompt
        if request.seed is not None:
            msg.seed = request.seed
        call = self.clients[request.tenant].generate_call(msg, timeout=request.timeout_s)
        finished = False
        try:
            async for resp in call:
                last = resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield Chunk(
                    tokens=len(resp.token_ids),
                    finish_reason=pb.FinishReason.Name(resp.finish_reason)
                    .removeprefix("FINISH_REASON_")
                    .lower()
                    if last
                    else None,
                    prompt_tokens=resp.usage.prompt_tokens if resp.HasField("usage") else None,
                    completion_tokens=resp.usage.completion_tokens if resp.HasField("usage") else None,
                )
            finished = True
        except grpc.aio.AioRpcError as exc:
            finished = True
            raise DriverError(exc.code().name, exc.details() or "") from None
        finally:
            if not finished:
                call.cancel()  # the caller stopped early (end of run): the server aborts the request

    async def close(self) -> None:
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                await client.close()


_PB_PRIORITY: dict[Priority | None, int] = {
    None: pb.PRIORITY_UNSPECIFIED,
    Priority.INTERACTIVE: pb.PRIORITY_INTERACTIVE,
    Priority.STANDARD: pb.PRIORITY_STANDARD,
    Priority.BATCH: pb.PRIORITY_BATCH,
}
