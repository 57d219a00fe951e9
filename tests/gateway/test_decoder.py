"""Large HTTP bodies are decoded in the decoder process: the gateway's event loop keeps running while
a body of a hundred thousand values is decoded, what comes back is small, and a decoder that died is
replaced."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

import gateway.http.body as body_module
from gateway.errors import ErrorKind, GatewayError
from gateway.http.body import INLINE_DECODE_BYTES, decode
from gateway.http.schema import ChatCompletionRequest, unsupported_fields

TOOLS = {
    "model": "m",
    "max_tokens": 1,
    "messages": [{"role": "user", "content": "hi"}],
    "functions": [{"name": "f"}] * 300_000,
    "some_future_field": list(range(10_000)),
}


async def test_a_huge_body_is_decoded_without_stalling_the_loop() -> None:
    raw = json.dumps(TOOLS).encode()
    assert len(raw) > INLINE_DECODE_BYTES
    await decode(ChatCompletionRequest, raw)  # the first call starts the decoder process
    late: list[float] = []

    async def ticker() -> None:
        while True:
            due = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            late.append(time.perf_counter() - due)

    ticking = asyncio.create_task(ticker())
    started = time.perf_counter()
    body = await decode(ChatCompletionRequest, raw)
    took = time.perf_counter() - started
    ticking.cancel()
    assert took > 0.05  # real work was done meanwhile, elsewhere
    assert max(late) < min(0.05, took / 2)  # the loop ran throughout (in-process: stalled for `took`)
    assert body.model_extra == {"functions": ["set"]}  # ignored fields dropped, refused ones cut down
    assert unsupported_fields(body) == [("functions", "is not supported by Loom (use tools)")]


async def test_a_bad_body_is_refused_and_a_dead_decoder_is_replaced() -> None:
    bad = json.dumps({"model": "m", "messages": [{"role": "user", "content": [7] * 100_000}]}).encode()
    with pytest.raises(GatewayError) as info:
        await decode(ChatCompletionRequest, bad)
    assert info.value.kind is ErrorKind.INVALID_ARGUMENT and len(info.value.message) < 2048
    decoder = body_module._decoder
    assert decoder is not None and decoder._child is not None
    decoder._child.kill()  # the decoder dies (out of memory, say)
    decoder._child.wait()
    raw = json.dumps(TOOLS).encode()
    body = await decode(ChatCompletionRequest, raw)  # a new one serves the next body
    assert body.model == "m"
