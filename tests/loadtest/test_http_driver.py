"""The HTTP driver without a server: server-sent events cut anywhere, token counts from
log-probabilities, HTTP statuses and in-stream error events mapped to the report's code names, the
request body it sends, deadlines and dropped connections (httpx's MockTransport stands in for the
front; the byte streams are shaped as gateway/http/streaming.py writes them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from common import Priority
from loadtest.driver import (
    Chunk,
    ChunkReader,
    DriverError,
    DriverRequest,
    HttpDriver,
    NotLoopbackError,
    PerTenantDriver,
    SseDecoder,
    code_for_status,
    error_code,
    http_error,
    iter_chunks,
)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


HEADER = {"id": "cmpl-r1", "object": "text_completion", "created": 1, "model": "tiny"}


def completion_chunk(tokens: list[str], finish: str | None = None, usage: bool = True) -> bytes:
    lp = {
        "tokens": tokens,
        "token_logprobs": [-0.5] * len(tokens),
        "top_logprobs": [{} for _ in tokens],
        "text_offset": list(range(len(tokens))),
    }
    choice = {"index": 0, "text": "".join(tokens), "logprobs": lp, "finish_reason": finish}
    return sse({**HEADER, "choices": [choice], **({"usage": None} if usage else {})})


def usage_chunk(prompt: int, completion: int) -> bytes:
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return sse({**HEADER, "choices": [], "usage": u})


# A recorded-shape completion: "Hello" (1 token), a token whose text is held back (an incomplete
# character: empty text, one token), two tokens coalesced in one chunk, the final chunk with its
# finish reason, the usage chunk, [DONE].
STREAM = b"".join(
    [
        completion_chunk(["Hello"]),
        completion_chunk([""]),
        completion_chunk([" wor", "ld"]),
        completion_chunk(["!"], finish="length"),
        usage_chunk(7, 5),
        b"data: [DONE]\n\n",
    ]
)


def chunks_of(items: list[Chunk | DriverError]) -> list[Chunk]:
    assert all(isinstance(i, Chunk) for i in items)
    return [i for i in items if isinstance(i, Chunk)]


# ---- SSE decoding --------------------------------------------------------------------------------


def test_sse_events_survive_any_cut_of_the_byte_stream() -> None:
    whole = SseDecoder().feed(STREAM)
    assert len(whole) == 6 and whole[-1] == "[DONE]"
    for step in (1, 2, 3, 7, 64):
        d = SseDecoder()
        got: list[str] = []
        for i in range(0, len(STREAM), step):
            got += d.feed(STREAM[i : i + step])
        assert got == whole, step


def test_sse_line_endings_comments_fields_and_multiline_data() -> None:
    raw = (
        b": a comment, then a keep-alive\r\n\r\n"
        b"event: message\r\nid: 7\r\nretry: 10\r\ndata: one\r\n\r\n"
        b"data:two\rdata:  three\r\r"
        b"data\n\n"  # a field with no colon: data with an empty value
        b"data: unfinished"  # never ended by a blank line: dropped
    )
    d = SseDecoder()
    out: list[str] = []
    for i in range(len(raw)):  # byte by byte: a CR at the end of what was fed waits for the next
        out += d.feed(raw[i : i + 1])
    assert out == ["one", "two\n three", ""]


def test_tokens_are_counted_from_each_chunks_logprobs() -> None:
    for split in (None, 1, 5):
        chunks = chunks_of(list(iter_chunks(STREAM, split)))
        assert [c.tokens for c in chunks] == [1, 1, 2, 1, 0]
        assert chunks[3].finish_reason == "length"
        assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (7, 5)
        assert sum(c.tokens for c in chunks) == chunks[-1].completion_tokens


def test_chat_chunks_count_logprobs_content() -> None:
    def chat(tokens: list[str], role: bool = False, finish: str | None = None) -> bytes:
        delta = {"content": "".join(tokens), **({"role": "assistant"} if role else {})}
        lp = {"content": [{"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in tokens]}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**HEADER, "object": "chat.completion.chunk", "choices": [choice]})

    final = {
        **HEADER,
        "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop"}],
    }
    raw = (
        chat(["Hi"], role=True) + chat([" there", "."]) + sse(final) + usage_chunk(3, 3) + b"data: [DONE]\n\n"
    )
    chunks = chunks_of(list(iter_chunks(raw)))
    # The final chunk carries no logprobs: it brought no token (the server counts by logprobs).
    assert [c.tokens for c in chunks] == [1, 2, 0, 0]
    assert chunks[2].finish_reason == "stop" and chunks[3].completion_tokens == 3


def test_without_any_logprobs_each_chunk_with_text_counts_one_and_says_so() -> None:
    plain = {**HEADER, "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}
    empty = {**HEADER, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]}
    reader = ChunkReader()
    got = chunks_of(reader.feed(sse(plain) + sse(plain) + sse(empty) + b"data: [DONE]\n\n"))
    assert [c.tokens for c in got] == [1, 1, 0] and reader.approximate and reader.done


def test_an_error_event_ends_the_stream_with_its_code_after_the_chunks_before_it() -> None:
    err = {
        "error": {
            "message": "the replica went away",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
    }
    raw = completion_chunk(["a"]) + sse(err) + b"data: [DONE]\n\n" + completion_chunk(["late"])
    items = list(iter_chunks(raw))
    assert isinstance(items[0], Chunk) and items[0].tokens == 1
    assert isinstance(items[1], DriverError) and len(items) == 2
    assert (items[1].code, items[1].message) == ("UNAVAILABLE", "the replica went away")


def test_nothing_after_done_counts_and_garbage_is_internal() -> None:
    reader = ChunkReader()
    assert chunks_of(reader.feed(b"data: [DONE]\n\n" + completion_chunk(["x"]))) == []
    assert reader.done
    (bad,) = ChunkReader().feed(b"data: {not json\n\n")
    assert isinstance(bad, DriverError) and bad.code == "INTERNAL"
    (bad,) = ChunkReader().feed(b"data: [1, 2]\n\n")
    assert isinstance(bad, DriverError) and bad.code == "INTERNAL"


# ---- HTTP errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, "INVALID_ARGUMENT"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "NOT_FOUND"),
        (409, "ALREADY_EXISTS"),
        (429, "RESOURCE_EXHAUSTED"),
        (499, "CANCELLED"),
        (500, "INTERNAL"),
        (503, "UNAVAILABLE"),
        (504, "DEADLINE_EXCEEDED"),
        (418, "HTTP_418"),
    ],
)
def test_each_status_maps_to_the_reports_code_name(status: int, code: str) -> None:
    assert code_for_status(status) == code


def test_error_bodies_and_events_are_read_by_status_then_code_then_type() -> None:
    body = {"error": {"message": "m", "type": "rate_limit_error", "param": None, "code": "tokens_per_minute"}}
    assert error_code(body, 429) == ("RESOURCE_EXHAUSTED", "m")
    assert error_code({"error": {"message": "m", "code": 504}}) == ("DEADLINE_EXCEEDED", "m")
    assert error_code({"error": {"message": "m", "code": "429"}}) == ("RESOURCE_EXHAUSTED", "m")
    assert error_code({"error": {"message": "m", "code": "resource_exhausted"}}) == (
        "RESOURCE_EXHAUSTED",
        "m",
    )
    assert error_code({"error": {"message": "m", "type": "timeout", "code": None}}) == (
        "DEADLINE_EXCEEDED",
        "m",
    )
    assert error_code({"error": {"message": "m"}})[0] == "INTERNAL"
    assert error_code("not an object", 418)[0] == "HTTP_418"


def test_http_error_keeps_the_message_and_retry_after() -> None:
    body = json.dumps(
        {"error": {"message": "over 60 requests a minute", "type": "rate_limit_error"}}
    ).encode()
    err = http_error(429, body, {"retry-after": "3"})
    assert err.code == "RESOURCE_EXHAUSTED"
    assert err.message == "HTTP 429: over 60 requests a minute (Retry-After: 3 s)"
    assert http_error(502, b"<html>bad gateway</html>").message == "HTTP 502: <html>bad gateway</html>"


# ---- the driver over a stand-in transport ----------------------------------------------------------


def request(**kw: Any) -> DriverRequest:
    fields: dict[str, Any] = {
        "request_id": "lt-1-0",
        "tenant": "acme",
        "model": "tiny",
        "prompt": "hello there",
        "chat": False,
        "max_tokens": 5,
        "temperature": 0.0,
        "priority": Priority.BATCH,
        "seed": None,
        "timeout_s": 5.0,
    }
    return DriverRequest(**{**fields, **kw})


Handler = Callable[[httpx.Request], Any]


def driver(handler: Handler) -> HttpDriver:
    return HttpDriver("127.0.0.1:8000", {"acme": "loom_key"}, transport=httpx.MockTransport(handler))


async def trickle(data: bytes, step: int = 11, pause_s: float = 0.0) -> AsyncIterator[bytes]:
    """``data`` in pieces of ``step`` bytes (0: one event at a time), ``pause_s`` between two."""
    pieces = (
        [e + b"\n\n" for e in data.split(b"\n\n") if e]
        if step == 0
        else [data[i : i + step] for i in range(0, len(data), step)]
    )
    for i, piece in enumerate(pieces):
        if pause_s and i:
            await asyncio.sleep(pause_s)
        yield piece


async def collect(d: HttpDriver, r: DriverRequest) -> list[Chunk]:
    try:
        return [c async for c in d.stream(r)]
    finally:
        await d.close()


async def test_a_completion_streams_with_the_body_loom_needs() -> None:
    seen: list[httpx.Request] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=trickle(STREAM))

    chunks = await collect(driver(handler), request(seed=11, temperature=0.7))
    assert [c.tokens for c in chunks] == [1, 1, 2, 1, 0]
    (req,) = seen
    assert req.url.path == "/v1/completions" and req.headers["authorization"] == "Bearer loom_key"
    body = json.loads(req.content)
    assert body == {
        "model": "tiny",
        "prompt": "hello there",
        "max_tokens": 5,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 0,
        "request_id": "lt-1-0",
        "priority": "batch",
        "seed": 11,
    }


async def test_a_chat_workload_posts_messages_with_logprobs() -> None:
    seen: list[dict[str, Any]] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1/chat/completions"
        seen.append(json.loads(req.content))
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    assert await collect(driver(handler), request(chat=True, priority=None)) == []
    (body,) = seen
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["logprobs"] is True and "prompt" not in body and "priority" not in body


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, "INVALID_ARGUMENT"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "NOT_FOUND"),
        (429, "RESOURCE_EXHAUSTED"),
        (500, "INTERNAL"),
        (503, "UNAVAILABLE"),
        (504, "DEADLINE_EXCEEDED"),
    ],
)
async def test_a_refusal_raises_its_code(status: int, code: str) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        body = {"error": {"message": "no", "type": "x", "param": None, "code": "whatever"}}
        return httpx.Response(status, json=body, headers={"Retry-After": "2"} if status == 429 else {})

    with pytest.raises(DriverError) as info:
        await collect(driver(handler), request())
    assert info.value.code == code
    assert ("Retry-After: 2" in info.value.message) == (status == 429)


async def test_an_error_event_mid_stream_raises_after_the_tokens_before_it() -> None:
    err = {"error": {"message": "deadline", "type": "timeout", "param": None, "code": 504}}
    raw = completion_chunk(["a"]) + completion_chunk(["b"]) + sse(err) + b"data: [DONE]\n\n"

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle(raw, step=5))

    got: list[Chunk] = []
    d = driver(handler)
    with pytest.raises(DriverError) as info:
        async for c in d.stream(request()):
            got.append(c)
    await d.close()
    assert [c.tokens for c in got] == [1, 1] and info.value.code == "DEADLINE_EXCEEDED"


async def test_a_stream_cut_before_done_is_unavailable() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=completion_chunk(["a"]))

    with pytest.raises(DriverError) as info:
        await collect(driver(handler), request())
    assert info.value.code == "UNAVAILABLE" and "[DONE]" in info.value.message


async def test_a_refused_connection_is_unavailable() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    with pytest.raises(DriverError) as info:
        await collect(driver(handler), request())
    assert info.value.code == "UNAVAILABLE" and "ConnectError" in info.value.message


async def test_the_client_deadline_bounds_the_whole_stream() -> None:
    def handler(req: httpx.Request) -> httpx.Response:  # the first event at once, then one every 0.2 s
        return httpx.Response(200, content=trickle(STREAM, step=0, pause_s=0.2))

    got: list[Chunk] = []
    d = driver(handler)
    with pytest.raises(DriverError) as info:
        async for c in d.stream(request(timeout_s=0.5)):
            got.append(c)
    await d.close()
    assert info.value.code == "DEADLINE_EXCEEDED"
    # Every gap is shorter than the deadline, so only a deadline over the whole stream ends it early.
    assert 1 <= sum(c.tokens for c in got) < 5


async def test_closing_the_stream_early_does_not_wait_for_the_rest() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield completion_chunk(["a"])
        await asyncio.sleep(30)
        yield b"data: [DONE]\n\n"

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    d = driver(handler)
    stream = d.stream(request())
    first = await anext(stream)
    assert first.tokens == 1
    await asyncio.wait_for(stream.aclose(), 2.0)  # the runner's end of run: the response is dropped
    await d.close()


def test_only_loopback_host_port_targets() -> None:
    with pytest.raises(NotLoopbackError):
        HttpDriver("10.0.0.1:8000", {})
    with pytest.raises(NotLoopbackError):
        HttpDriver("unix:/tmp/loom.sock", {})
    HttpDriver("localhost:8000", {})
    HttpDriver("[::1]:8000", {})


async def test_per_tenant_driver_routes_each_tenant_to_its_front() -> None:
    calls: list[tuple[str, str]] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name
            self.closed = False

        async def stream(self, r: DriverRequest) -> AsyncIterator[Chunk]:
            calls.append((self.name, r.tenant))
            yield Chunk(tokens=1)

        async def close(self) -> None:
            self.closed = True

    grpc_d, http_d = Fake("grpc"), Fake("http")
    d = PerTenantDriver({"grpc": grpc_d, "http": http_d}, {"acme": "http", "globex": "grpc"})
    assert d.name == "grpc+http"
    for tenant in ("acme", "globex"):
        assert [c.tokens async for c in d.stream(request(tenant=tenant))] == [1]
    assert calls == [("http", "acme"), ("grpc", "globex")]
    await d.close()
    assert grpc_d.closed and http_d.closed
    with pytest.raises(ValueError, match="http"):
        PerTenantDriver({"grpc": grpc_d}, {"acme": "http"})
