"""Several gateway processes on one host share their ports (SO_REUSEPORT) and the tenants' quotas:
admission is in Redis, so a quota holds exactly whichever process a connection lands on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.grpc.client import LoomClient
from tenancy import TenancySettings
from tests.conftest import free_port
from tests.gateway.conftest import TINY, Gateway, private_gateway
from tests.gateway.test_gateway_e2e import collect, req


def _counting(server: Any, seen: list[int], index: int) -> None:
    """Count the calls each gateway's request path takes (its services call ``path.generate``)."""
    generate = server.path.generate

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen[index] += 1
        return generate(*args, **kwargs)

    server.path.generate = counted


async def _one(address: str, key: str) -> str:
    """One completion on a connection of its own (the kernel picks the gateway that accepts it). Over
    HTTP: gRPC clients in one process share one connection per address."""
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as http:
        response = await http.post(
            "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": TINY, "prompt": "hello loom", "max_tokens": 1},
        )
    return {200: "OK", 429: "RESOURCE_EXHAUSTED"}.get(response.status_code, str(response.status_code))


async def _grpc_one(address: str, key: str) -> str:
    async with LoomClient(address, key) as client:
        try:
            await collect(client.generate_call(req(max_tokens=1)))
            return "OK"
        except grpc.aio.AioRpcError as err:
            return err.code().name


async def test_two_gateways_share_one_port_and_a_quota_across_them_stays_exact(
    gateway: Gateway, engine_handles: dict[str, Any], tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    _, key = await gateway.tenant(quotas={"requests_per_minute": 6})
    port, http_port = free_port(), free_port()
    shared = dict(port=port, http_port=http_port, reuse_port=True)
    handle = engine_handles["tiny"]
    async with (
        private_gateway(handle, tenancy_settings, tiny_dir, **shared) as first,
        private_gateway(handle, tenancy_settings, tiny_dir, **shared) as second,
    ):
        assert first.port == second.port == port and first.http_address == second.http_address
        seen = [0, 0]
        _counting(first, seen, 0)
        _counting(second, seen, 1)
        codes = await asyncio.gather(*(_one(f"127.0.0.1:{http_port}", key) for _ in range(24)))
        codes.append(await _grpc_one(f"127.0.0.1:{port}", key))  # the shared gRPC port counts as well
    assert sorted(codes) == ["OK"] * 6 + ["RESOURCE_EXHAUSTED"] * 19
    assert min(seen) > 0 and sum(seen) == 25  # both took connections (24 coin flips)


async def test_without_reuse_port_a_second_gateway_on_a_port_in_use_fails_to_start(
    engine_handles: dict[str, Any], tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    port = free_port()
    async with private_gateway(engine_handles["tiny"], tenancy_settings, tiny_dir, port=port, http_port=None):
        with pytest.raises(OSError):
            async with private_gateway(
                engine_handles["tiny"], tenancy_settings, tiny_dir, port=port, http_port=None
            ):
                pass


async def test_an_http_port_in_use_is_an_os_error_and_the_loop_goes_on(
    engine_handles: dict[str, Any], tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    """uvicorn binding for itself would sys.exit on a port in use: in a Serve replica that ended the
    loop running the gateway's constructor, which then never returned (the replica hung starting)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        http_port = taken.getsockname()[1]
        with pytest.raises(OSError):
            async with private_gateway(
                engine_handles["tiny"], tenancy_settings, tiny_dir, http_port=http_port
            ):
                pass
    await asyncio.sleep(0)  # the loop is still running
