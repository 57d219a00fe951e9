"""How the load generator talks to a front: one small interface, a gRPC and an HTTP implementation.

The runner only needs "stream this request, tell me each chunk's token count as it arrives, or
raise with a status code", so that is the whole interface (:class:`Driver`). The gRPC driver wraps
``gateway.grpc.client.LoomClient``; the HTTP driver streams the OpenAI-compatible front's
``/v1/completions`` (``/v1/chat/completions`` for a chat workload) as server-sent events and maps
HTTP statuses and in-stream error events to the same gRPC code names (429 ``RESOURCE_EXHAUSTED``,
401 ``UNAUTHENTICATED``...), so reports stay comparable across fronts. :class:`PerTenantDriver`
sends each tenant's requests through the front its workload entry names.

Token timing over HTTP: each request asks for ``logprobs: 0`` (chat: ``logprobs: true``), so every
chunk carries one log-probability entry per token it delivers (``logprobs.tokens`` /
``logprobs.content``); that count is exact chunk by chunk, whatever the server coalesces or holds
back (a chunk whose text is held back for an incomplete character still carries its token), which is
what the inter-token gaps need. ``stream_options.include_usage`` adds the final usage (prompt and
completion tokens), as the gRPC stream's last message carries it. The final usage alone would give
the total but not which chunk brought which token.

Only loopback targets are accepted: a load generator pointed at someone else's server by a typo is
a denial-of-service tool, and this one is meant for the machine it runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
import httpx

from common import Priority
from gateway.grpc.client import LoomClient
from gateway.grpc.stubs import pb


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


# Streams a driver opens on one connection: below the gateway's HTTP/2 cap per connection (128 by
# default), which refuses streams beyond it (REFUSED_STREAM, seen as UNAVAILABLE).
STREAMS_PER_CONNECTION = 100


@dataclass
class _Connection:
    client: LoomClient  # a channel with its own connection (a local subchannel pool)
    open_streams: int = 0


class GrpcDriver:
    """``loom.v1.Inference/Generate`` as separate clients would call it: each tenant over connections
    of its own (never shared with another tenant's, as gRPC's global subchannel pool would share
    them), a new one opened whenever the tenant's open ones each carry ``STREAMS_PER_CONNECTION``."""

    name = "grpc"

    def __init__(self, address: str, keys: dict[str, str]) -> None:
        self.address = require_loopback(address)
        self.keys = keys
        self.connections: dict[str, list[_Connection]] = {t: [] for t in keys}

    def _connection(self, tenant: str) -> _Connection:
        """The tenant's least busy connection with room for a stream, or a new one."""
        free = [c for c in self.connections[tenant] if c.open_streams < STREAMS_PER_CONNECTION]
        if free:
            return min(free, key=lambda c: c.open_streams)
        conn = _Connection(
            LoomClient(self.address, self.keys[tenant], options=[("grpc.use_local_subchannel_pool", 1)])
        )
        self.connections[tenant].append(conn)
        return conn

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
        conn = self._connection(request.tenant)
        conn.open_streams += 1
        call = conn.client.generate_call(msg, timeout=request.timeout_s)
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
            conn.open_streams -= 1
            if not finished:
                call.cancel()  # the caller stopped early (end of run): the server aborts the request

    async def close(self) -> None:
        for conns in self.connections.values():
            for conn in conns:
                with contextlib.suppress(Exception):
                    await conn.client.close()


_PB_PRIORITY: dict[Priority | None, int] = {
    None: pb.PRIORITY_UNSPECIFIED,
    Priority.INTERACTIVE: pb.PRIORITY_INTERACTIVE,
    Priority.STANDARD: pb.PRIORITY_STANDARD,
    Priority.BATCH: pb.PRIORITY_BATCH,
}


# ---- the OpenAI-compatible HTTP front ------------------------------------------------------------

# HTTP status -> the gRPC code name the report counts: the inverse of the gateway's mapping
# (gateway/http/), plus what a proxy or another server might answer.
HTTP_CODES: dict[int, str] = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# OpenAI error ``type`` -> code name, for an error whose status or code says nothing better.
_ERROR_TYPES: dict[str, str] = {
    "invalid_request_error": "INVALID_ARGUMENT",
    "authentication_error": "UNAUTHENTICATED",
    "permission_error": "PERMISSION_DENIED",
    "not_found_error": "NOT_FOUND",
    "rate_limit_error": "RESOURCE_EXHAUSTED",
    "request_cancelled": "CANCELLED",
    "server_error": "INTERNAL",
    "service_unavailable": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED",
}
_CODE_NAMES = frozenset(c.name for c in grpc.StatusCode)


def code_for_status(status: int) -> str:
    """The gRPC code name of an HTTP status; ``HTTP_<status>`` for one with no counterpart."""
    return HTTP_CODES.get(status, f"HTTP_{status}")


def error_code(payload: Any, status: int | None = None) -> tuple[str, str]:
    """(code name, message) of an OpenAI error body or an in-stream error event.

    The HTTP status decides when there is one (the gateway's statuses are one per code); an error event
    inside a stream has none, so its ``code`` field does: a code name in either case (what the gateway
    sends, as in its JSON errors: ``deadline_exceeded``), or an HTTP status number (other servers);
    failing those, its ``type``."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(err, dict):
        err = {}
    message = str(err.get("message") or "")
    if status is not None and status in HTTP_CODES:
        return HTTP_CODES[status], message
    code = err.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        return code_for_status(code), message
    if isinstance(code, str) and code.upper() in _CODE_NAMES:
        return code.upper(), message
    kind = _ERROR_TYPES.get(str(err.get("type")))
    if kind is not None:
        return kind, message
    fallback = code_for_status(status) if status is not None else "INTERNAL"
    return fallback, message or json.dumps(payload)[:300]


def http_error(
    status: int, body: bytes, headers: httpx.Headers | dict[str, str] | None = None
) -> DriverError:
    """The DriverError of a non-200 answer: its code by status, the server's message and Retry-After."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    code, message = error_code(payload, status)
    if not message:
        message = body[:200].decode(errors="replace") or f"HTTP {status}"
    retry = (headers or {}).get("retry-after")
    if retry is not None:
        message += f" (Retry-After: {retry} s)"
    return DriverError(code, f"HTTP {status}: {message}")


class SseDecoder:
    """Server-sent events from a byte stream cut anywhere (the WHATWG event-stream rules, data only).

    ``feed(bytes)`` returns the data of each event completed so far: its ``data:`` lines joined by
    newlines, one leading space of each value dropped. Comments (``:...``) and the ``event``, ``id``
    and ``retry`` fields are read past. Lines end with LF, CRLF or CR (a CR at the end of the bytes
    fed so far waits for the next byte, which may be its LF). An event not ended by a blank line
    when the stream ends is dropped, as the standard says."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        start = 0
        buf = self._buf
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf >= 0 else n)
            if cr >= 0:
                if cr == n - 1:
                    break  # a CR as the last byte: CRLF or CR, the next byte says
                end, nxt = cr, cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            elif lf >= 0:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(buf[start:end].decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
            start = nxt
        self._buf = buf[start:]
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def _choice_tokens(choice: dict[str, Any]) -> int | None:
    """Tokens one streamed choice carries: its log-probability entries (completions: ``tokens``,
    chat: ``content``); None when the chunk has no log-probabilities."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        entries = lp.get("tokens") if "tokens" in lp else lp.get("content")
        if isinstance(entries, list):
            return len(entries)
    return None


class ChunkReader:
    """The chunks of one streamed completion, from its SSE bytes as they arrive.

    ``feed(bytes)`` returns the chunks completed so far, in order, with a :class:`DriverError` last
    when the stream carried an error event (nothing after it counts); ``done`` once ``data: [DONE]``
    came. Tokens are counted from each chunk's log-probabilities (exact); should the server send none
    at all (a front that ignores ``logprobs``), every chunk with text counts one token, an
    approximation the ``approximate`` flag owns up to."""

    def __init__(self) -> None:
        self.sse = SseDecoder()
        self.done = False
        self.failed = False
        self.exact: bool | None = None  # None until a chunk with a choice says which
        self.approximate = False

    def feed(self, data: bytes) -> list[Chunk | DriverError]:
        out: list[Chunk | DriverError] = []
        for event in self.sse.feed(data):
            if self.done or self.failed:
                break
            item = self.parse(event)
            if item is None:
                self.done = True
            else:
                out.append(item)
                self.failed = isinstance(item, DriverError)
        return out

    def parse(self, data: str) -> Chunk | DriverError | None:
        """One event's data: a Chunk, a DriverError (an error event, or not a chunk), None for [DONE]."""
        if data.strip() == "[DONE]":
            return None
        try:
            event = json.loads(data)
        except ValueError:
            return DriverError("INTERNAL", f"not JSON in the event stream: {data[:120]!r}")
        if not isinstance(event, dict):
            return DriverError("INTERNAL", f"not an object in the event stream: {data[:120]!r}")
        if "error" in event:
            return DriverError(*error_code(event))
        tokens = 0
        finish: str | None = None
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            n = _choice_tokens(choice)
            if n is not None:
                self.exact = True
            elif self.exact:
                n = 0  # the server counts by log-probabilities: a chunk without them carried no token
            else:
                delta = choice.get("delta")
                text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
                n = 1 if text else 0
                self.approximate = self.approximate or bool(text)
            tokens += n
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return Chunk(
            tokens=tokens,
            finish_reason=finish,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )


def iter_chunks(data: bytes, split: int | None = None) -> Iterator[Chunk | DriverError]:
    """The chunks of a recorded event stream (fed whole, or ``split`` bytes at a time): for tests and
    for reading a capture."""
    reader = ChunkReader()
    step = split or max(1, len(data))
    for i in range(0, len(data), step):
        yield from reader.feed(data[i : i + step])


class HttpDriver:
    """``POST /v1/completions`` (chat: ``/v1/chat/completions``) with ``stream: true``, over one
    httpx client (HTTP/1.1, a connection per stream in flight, kept alive between them).

    The request asks for ``logprobs: 0`` (chat: ``logprobs: true``) so each chunk's tokens can be
    counted exactly, and ``stream_options: {include_usage: true}`` for the final usage; Loom's
    priority rides as the ``priority`` body field and the request id as ``request_id``. The client's
    deadline (``timeout_s``) bounds the whole call, as a gRPC deadline does: past it the connection is
    dropped (the gateway aborts the request) and the call ends ``DEADLINE_EXCEEDED``. Transport
    failures (refused or dropped connection) end it ``UNAVAILABLE``, as gRPC would name them.
    """

    name = "http"

    def __init__(
        self,
        address: str,
        keys: dict[str, str],
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        keepalive_expiry_s: float = 4.0,
    ) -> None:
        self.address = require_loopback(address)
        if address.startswith(("unix:", "unix-abstract:")):
            raise NotLoopbackError(f"{address!r}: the HTTP front listens on host:port")
        self.keys = dict(keys)
        # The gateway closes idle keep-alive connections after http_keepalive_s (5 s by default):
        # drop them client-side first, so a request never races the server's close.
        self.client = httpx.AsyncClient(
            base_url=f"http://{address}",
            transport=transport,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=256, keepalive_expiry=keepalive_expiry_s
            ),
            trust_env=False,  # never through a proxy named by the environment: loopback means loopback
        )
        self.approximate_streams = 0  # streams whose tokens were counted without log-probabilities

    @staticmethod
    def body(request: DriverRequest) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body of a request."""
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "request_id": request.request_id,
        }
        if request.chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["logprobs"] = True  # top_logprobs unset: the sampled token's only
        else:
            path = "/v1/completions"
            body["prompt"] = request.prompt
            body["logprobs"] = 0
        if request.priority is not None:
            body["priority"] = request.priority.value
        if request.seed is not None:
            body["seed"] = request.seed
        return path, body

    async def stream(self, request: DriverRequest) -> AsyncIterator[Chunk]:
        path, body = self.body(request)
        key = self.keys[request.tenant]
        deadline = asyncio.get_running_loop().time() + request.timeout_s
        http_request = self.client.build_request(
            "POST", path, json=body, headers={"authorization": f"Bearer {key}", "accept": "text/event-stream"}
        )
        response: httpx.Response | None = None
        reader = ChunkReader()
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.client.send(http_request, stream=True)
            if response.status_code != 200:
                async with asyncio.timeout_at(deadline):
                    raw = await response.aread()
                raise http_error(response.status_code, raw, response.headers)
            async with contextlib.aclosing(response.aiter_bytes()) as received:
                while not reader.done:
                    async with asyncio.timeout_at(deadline):
                        data = await anext(received, None)
                    if data is None:
                        raise DriverError("UNAVAILABLE", "the event stream ended without data: [DONE]")
                    for item in reader.feed(data):
                        if isinstance(item, DriverError):
                            raise item
                        yield item
                # After [DONE] only the end of the chunked body is left: read it, so the connection
                # goes back to the pool rather than being closed.
                async with asyncio.timeout_at(deadline):
                    async for _ in received:
                        pass
        except TimeoutError:
            message = f"no complete answer within {request.timeout_s:g} s"
            raise DriverError("DEADLINE_EXCEEDED", message) from None
        except httpx.TimeoutException as exc:
            raise DriverError("DEADLINE_EXCEEDED", f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:
            raise DriverError("UNAVAILABLE", f"{type(exc).__name__}: {exc}") from None
        finally:
            if reader.approximate:
                self.approximate_streams += 1
            if response is not None:
                await response.aclose()  # mid-stream (the caller stopped early): drops the connection

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()


class PerTenantDriver:
    """Each tenant's requests through the driver of its own front (a workload may mix them)."""

    def __init__(self, drivers: dict[str, Driver], fronts: dict[str, str]) -> None:
        missing = sorted({f for f in fronts.values()} - set(drivers))
        if missing:
            raise ValueError(f"no driver for front(s) {', '.join(missing)}")
        self.drivers = drivers
        self.fronts = fronts
        self.name = "+".join(sorted({fronts[t] for t in fronts}))

    def stream(self, request: DriverRequest) -> AsyncIterator[Chunk]:
        return self.drivers[self.fronts[request.tenant]].stream(request)

    async def close(self) -> None:
        for driver in self.drivers.values():
            await driver.close()
