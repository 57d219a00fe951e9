"""Deltas to the client: server-sent events under a stall guard, or one answer that is not computed
for a client who left.

A streamed answer's first delta is awaited before any header is sent, so a refusal is still an HTTP
status; after the headers, an error travels as an event in the same shape as a JSON error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Send

from gateway.errors import ErrorKind, GatewayError
from gateway.http.endpoints import Choice, Endpoint, usage_json
from gateway.http.errors import error_body
from gateway.schema import Delta
from gateway.stall_watch import StallWatch, StreamStalled

log = logging.getLogger(__name__)
T = TypeVar("T")


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # one, not one per chunk


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


async def stream_answer(
    deltas: AsyncGenerator[Delta, None], endpoint: Endpoint, body: Any, watch: StallWatch, request: Request
) -> Response:
    try:
        # Until the first delta (admission, the queue, the prompt) nothing is written, so only the
        # receive channel tells that the client left: a request queued for a client who is gone is
        # aborted now, not when its first token finds the socket closed.
        first = await unless_client_leaves(anext(deltas), request)
    except StopAsyncIteration:  # pragma: no cover - the path always yields a final delta
        raise GatewayError(ErrorKind.INTERNAL, "internal error") from None
    except BaseException:
        await deltas.aclose()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    header = {
        "id": endpoint.id_prefix + first.request_id,
        "object": endpoint.chunk_object,
        "created": int(time.time()),
        "model": body.model,
    }

    async def events() -> AsyncIterator[bytes]:
        started: set[int] = set()
        state = endpoint.stream_state(body)
        async with contextlib.aclosing(deltas):
            delta: Delta | None = first
            try:
                while delta is not None:
                    choice = endpoint.chunk_choice(delta, delta.index not in started, state)
                    started.add(delta.index)
                    if choice is not None:
                        chunk = {**header, "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
                    if delta.usage is not None and include_usage:
                        yield sse({**header, "choices": [], "usage": usage_json(delta)})
                    delta = await anext(deltas, None)
            except GatewayError as err:  # after the headers: the error travels as an event
                yield sse(error_body(err))
        yield b"data: [DONE]\n\n"

    return StallGuardedStream(
        watch,
        events(),
        media_type="text/event-stream",
        headers={"X-Request-Id": first.request_id, "Cache-Control": "no-cache"},
    )


async def whole_answer(
    deltas: AsyncGenerator[Delta, None], endpoint: Endpoint, body: Any, request: Request
) -> Response:
    choices: dict[int, Choice] = {}
    last: Delta | None = None

    async def collect() -> None:
        nonlocal last
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                choices.setdefault(delta.index, Choice()).add(delta)
                last = delta

    await unless_client_leaves(collect(), request)
    assert last is not None and last.usage is not None
    answer = endpoint.whole(last.request_id, body, choices, usage_json(last))
    return JSONResponse(answer.model_dump(), headers={"X-Request-Id": last.request_id})


class StallGuardedStream(StreamingResponse):
    """Server-sent events whose every write must complete within the watch's stall limit.

    A write waits only once the socket's buffers are full, that is when the client has read nothing
    for a while; then the stream is ended (the path's generator closes, aborting the engine work and
    settling the lease) instead of holding its slot and buffers for as long as the client lingers.
    """

    def __init__(self, watch: StallWatch, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.watch = watch

    async def stream_response(self, send: Send) -> None:
        watch, writer = self.watch, asyncio.current_task()
        assert writer is not None

        async def guarded(message: Message) -> None:
            await watch.write(writer, send(message))

        try:
            await super().stream_response(guarded)
        except StreamStalled as stalled:
            log.warning("%s; its stream was ended", stalled)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def unless_client_leaves(work: Awaitable[T], request: Request) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (which aborts the
    engine request and settles the lease) instead of computing an answer nobody will read."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise GatewayError(ErrorKind.CANCELLED, "the client went away")
    return task.result()
