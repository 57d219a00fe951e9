"""What reaches a client when the request is not a request, or the server has a bug: a precise status,
an id to quote, and nothing internal (no class names, tracebacks, Ray ids or addresses)."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from tests.gateway.conftest import TINY, Gateway
from tests.gateway.test_gateway_e2e import collect, req

GENERATE = "/loom.v1.Inference/Generate"


async def _raw_generate(gateway: Gateway, key: str | None, body: bytes) -> grpc.aio.AioRpcError:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call(body, metadata=metadata):
                pass
    return info.value


def _requests(tenant: str, code: str) -> float:
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "loom:gateway_requests"
        for s in m.samples
        if s.labels.get("tenant") == tenant and s.labels.get("code") == code and s.name.endswith("_total")
    )


async def test_an_undecodable_body_is_invalid_argument_after_authentication(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant()
    garbage = b"\xff\xff\xff\xff\x0f" + bytes(range(40))
    before = _requests(tenant.id, "INVALID_ARGUMENT")
    err = await _raw_generate(gateway, key, garbage)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request" in err.details() and "GenerateRequest" in err.details()
    assert "Exception" not in err.details() and "Error" not in err.details()
    assert _requests(tenant.id, "INVALID_ARGUMENT") == before + 1  # the code the client got, counted
    anonymous = await _raw_generate(gateway, None, garbage)
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED  # the key is checked before the body


async def test_a_bug_is_internal_with_an_id_and_nothing_else(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, key = await gateway.tenant()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("actor 9f3c2 on node 10.0.0.7:6380 exploded")

    monkeypatch.setattr(gateway.server.path, "_tag", broken)
    before = _requests(tenant.id, "INTERNAL")
    async with gateway.client(key) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(client.generate_call(req(request_id="find-me-42", max_tokens=2)))
    err = info.value
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "internal error (request find-me-42)"
    assert _requests(tenant.id, "INTERNAL") == before + 1
    url = f"http://{gateway.server.http_address}/v1/completions"
    async with httpx.AsyncClient() as http:
        r = await http.post(
            url,
            json={"model": TINY, "prompt": "x", "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
        )
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "10.0.0.7" not in r.text and "RuntimeError" not in r.text


async def test_a_client_that_stops_reading_loses_its_stream_and_frees_its_slot(
    gateway: Gateway, tenancy_settings: Any, tiny_dir: Any
) -> None:
    import asyncio
    import json as jsonlib
    import socket

    from tests.gateway.conftest import engine_idle, eventually, private_gateway

    _, key = await gateway.tenant(quotas={"max_concurrent": 1})
    handle = gateway.handles["tiny"]
    async with private_gateway(handle, tenancy_settings, tiny_dir, stream_stall_timeout_s=1.0) as server:
        host, port = server.http_address.rsplit(":", 1)
        body = jsonlib.dumps(
            {
                "model": TINY,
                "prompt": "go on",
                "max_tokens": 1000,
                "temperature": 0,
                "stream": True,
                "logprobs": 20,
            }
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that never reads
        sock.connect((host, int(port)))
        # Shrink the server's side of this one connection too: Linux would otherwise buffer megabytes
        # on loopback before a write has to wait, longer than a test should stream.
        uvicorn_server = server.http._server
        await eventually(lambda: len(uvicorn_server.server_state.connections) == 1)
        (connection,) = uvicorn_server.server_state.connections
        connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        try:

            async def slot_free() -> bool:  # the tenant's only slot comes back once the stream is ended
                async with httpx.AsyncClient() as http:
                    r = await http.post(
                        f"http://{server.http_address}/v1/completions",
                        json={"model": TINY, "prompt": "x", "max_tokens": 1},
                        headers={"authorization": f"Bearer {key}"},
                    )
                assert r.status_code in (200, 429), r.text
                return r.status_code == 200

            await eventually(slot_free, timeout_s=30, interval_s=0.5)
            await eventually(lambda: engine_idle(handle), timeout_s=30)
        finally:
            sock.close()
            await asyncio.sleep(0)


async def test_a_grpc_client_that_stops_reading_loses_its_stream_and_frees_its_slot(
    gateway: Gateway, tenancy_settings: Any, tiny_dir: Any
) -> None:
    """The gRPC front's writes are under the same stall watch as the HTTP front's."""
    from gateway.grpc.client import LoomClient
    from tests.gateway.conftest import engine_idle, eventually, private_gateway

    _, key = await gateway.tenant(quotas={"max_concurrent": 1})
    handle = gateway.handles["tiny"]
    async with private_gateway(handle, tenancy_settings, tiny_dir, stream_stall_timeout_s=1.0) as server:
        # A receive window of 1 KB that never grows: the server's writes wait once it is full.
        stalled_client = LoomClient(
            server.address, key, options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        )
        async with stalled_client:
            call = stalled_client.generate_call(
                req(prompt="go on", max_tokens=1000, temperature=0, logprobs=20)
            )  # sent, never read

            async def generating() -> bool:
                return not await engine_idle(handle)

            await eventually(generating, timeout_s=30)  # it holds the tenant's only slot

            async def slot_free() -> bool:
                async with LoomClient(server.address, key) as client:
                    try:
                        await collect(client.generate_call(req(max_tokens=1)))
                    except grpc.aio.AioRpcError as err:
                        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                        return False
                return True

            await eventually(slot_free, timeout_s=30, interval_s=0.5)
            await eventually(lambda: engine_idle(handle), timeout_s=30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(call)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "read nothing for 1 s" in (info.value.details() or "")
