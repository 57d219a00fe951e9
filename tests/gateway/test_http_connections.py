"""The HTTP front's bounds on connections, over real sockets: headers that never finish are cut off,
a body that never finishes is given up, and no source (nor all together) holds more than its cap."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.errors import GatewayError
from gateway.http.body import MAX_BODY_BYTES, read_body
from gateway.http.connections import ConnectionLimits, bounded_protocol
from gateway.http.errors import on_gateway_error

HEADER_TIMEOUT_S = 0.4
BODY_TIMEOUT_S = 0.4


def _app() -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(GatewayError, on_gateway_error)

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await read_body(request, BODY_TIMEOUT_S))})

    return app


@contextlib.asynccontextmanager
async def _front(per_source: int = 3, total: int = 100) -> AsyncIterator[tuple[int, ConnectionLimits]]:
    limits = ConnectionLimits(total, per_source, HEADER_TIMEOUT_S)
    config = uvicorn.Config(
        _app(), host="127.0.0.1", port=0, lifespan="off", log_level="warning", http=bounded_protocol(limits)
    )
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], limits
    finally:
        server.should_exit = True
        await task


async def _read_all(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    async with asyncio.timeout(timeout_s):
        return await reader.read(-1)  # until the server closes


async def test_headers_that_never_finish_get_408_and_are_closed() -> None:
    async with _front() as (port, limits):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await _read_all(reader)
        assert reply.startswith(b"HTTP/1.1 408")
        assert loop.time() - started < HEADER_TIMEOUT_S + 2
        writer.close()
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        assert (await _read_all(silent_reader)).startswith(b"HTTP/1.1 408")
        silent.close()
        assert limits.timed_out == 2
        await _eventually_empty(limits)


async def test_a_keep_alive_connection_gets_a_header_deadline_for_each_request() -> None:
    async with _front() as (port, limits):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        first = await asyncio.wait_for(reader.readuntil(b'{"bytes":2}'), 5)
        assert first.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)  # longer than a header deadline, idle: kept alive
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # the second request stalls
        assert b"HTTP/1.1 408" in await _read_all(reader)
        writer.close()
        await _eventually_empty(limits)


async def test_a_body_that_never_finishes_is_given_up() -> None:
    async with _front() as (port, limits):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nonly part")
        reply = await _read_all(reader, BODY_TIMEOUT_S + 5)  # answered, then closed: the rest never comes
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within" in reply
        writer.close()
        await _eventually_empty(limits)


async def test_a_body_over_the_limit_is_413_and_the_connection_closes() -> None:
    async with _front() as (port, limits):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        declared = MAX_BODY_BYTES + 1
        writer.write(f"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: {declared}\r\n\r\nxx".encode())
        reply = await _read_all(reader)
        assert reply.startswith(b"HTTP/1.1 413") and b"the limit is" in reply
        writer.close()
        await _eventually_empty(limits)


async def test_connections_are_capped_per_source_and_in_all() -> None:
    async with _front(per_source=3, total=100) as (port, limits):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _read_all(reader, 2)).startswith(b"HTTP/1.1 503")  # refused at once
        writer.close()
        held[0][1].close()
        await held[0][1].wait_closed()
        await _eventually(lambda: limits.open["127.0.0.1"] == 2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # room again
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"}"), 5)).startswith(b"HTTP/1.1 200")
        for _, w in [*held[1:], (reader, writer)]:
            w.close()
        await _eventually_empty(limits)
        assert limits.refused == 1
    async with _front(per_source=100, total=2) as (port, limits):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _read_all(reader, 2)).startswith(b"HTTP/1.1 503")
        for _, w in [*held, (reader, writer)]:
            w.close()
        await _eventually_empty(limits)


async def _eventually(check: object, timeout_s: float = 5.0) -> None:
    assert callable(check)
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


async def _eventually_empty(limits: ConnectionLimits) -> None:
    """Every connection closed is released: no slot leaks, whatever ended it."""
    await _eventually(lambda: not limits.open)
