"""Operating the gateway: health, reflection, metrics, drain, TLS, a killed worker, the Serve-deployed
gateway (the KubeRay shape)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.api import SERVICE_NAME, pb
from gateway.client import LoomClient
from gateway.settings import GatewaySettings
from loom.app import PoolSpec, engine_app
from tenancy import TenancySettings
from tests.gateway.conftest import (
    SECRET,
    TINY,
    Gateway,
    _tiny_engine,
    engine_idle,
    eventually,
    private_gateway,
    start_gateway,
)
from tests.gateway.test_gateway_e2e import collect, req


async def test_health_and_reflection(gateway: Gateway) -> None:
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo()
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        reply = await call.read()
        await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


async def test_metrics_endpoint_reports_requests_and_engine_gauges(gateway: Gateway) -> None:
    tenant, key = await gateway.tenant()
    async with gateway.client(key) as client:
        await collect(client.generate_call(req(max_tokens=4)))
    port = gateway.server.metrics_port
    assert port

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    await eventually(lambda: "loom:kv_cache_usage_perc{" in scrape())
    text = scrape()
    assert f'loom:gateway_requests_total{{code="OK",priority="standard",tenant="{tenant.id}"}} 1.0' in text
    assert f'loom:generation_tokens_total{{tenant="{tenant.id}"}} 4.0' in text
    assert 'loom:num_requests_running{model="tiny",pool="shared"' in text
    assert 'loom:num_requests_waiting{model="tiny",pool="shared",priority="batch"' in text
    assert "loom:time_to_first_token_seconds_bucket" in text
    assert 'loom:tenancy_quota_mode{mode="redis"} 1.0' in text


async def test_drain_finishes_streams_and_refuses_new_calls(
    gateway: Gateway, tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    server, tenancy = await start_gateway(gateway.handles, tenancy_settings, tiny_dir)
    _, key = await gateway.tenant()
    try:
        async with LoomClient(server.address, key) as client:
            call = client.generate_call(req(max_tokens=60, temperature=0.0, stop=[]))
            first = await call.read()
            stopping = asyncio.create_task(server.stop(grace_s=30.0))
            await asyncio.sleep(0.3)
            rest = []
            while (chunk := await call.read()) is not grpc.aio.EOF:
                rest.append(chunk)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(client.generate_call(req(max_tokens=2)))
            await stopping
    finally:
        await tenancy.stop()
    tokens = len(first.token_ids) + sum(len(c.token_ids) for c in rest)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and tokens == 60
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=loom-test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(ext),
            "-out",
            str(d / f"{name}.pem"),
        )
    return d


async def test_mutual_tls(
    gateway: Gateway, tenancy_settings: TenancySettings, tiny_dir: Path, pki: Path
) -> None:
    server, tenancy = await start_gateway(
        gateway.handles,
        tenancy_settings,
        tiny_dir,
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
        tls_client_ca_file=str(pki / "ca.pem"),
    )
    _, key = await gateway.tenant()
    ca = (pki / "ca.pem").read_bytes()
    client_pair = ((pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes())
    try:
        async with LoomClient(server.address, key, root_certificates=ca, client_cert=client_pair) as ok:
            _, _, ids, _ = await collect(ok.generate_call(req(max_tokens=3)))
        assert len(ids) == 3
        for client in (
            LoomClient(server.address, key, root_certificates=ca),
            LoomClient(server.address, key),
        ):
            async with client:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(client.generate_call(req(max_tokens=3), timeout=5))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(grace_s=0)
        await tenancy.stop()


@pytest.fixture(scope="module")
def fragile(ray_serve: None, tiny_dir: Path) -> Any:
    from ray import serve

    spec = PoolSpec(name="shared", engine=_tiny_engine(tiny_dir))
    handle = serve.run(engine_app(spec), name="engine-fragile", route_prefix=None)
    yield handle
    serve.delete("engine-fragile")


async def test_stream_survives_a_killed_worker(
    gateway: Gateway, fragile: Any, tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    tenant, key = await gateway.tenant(quotas={"max_concurrent": 1})
    request = req(prompt="the replica may die", max_tokens=300, temperature=0.0, stop=[])
    async with private_gateway(fragile, tenancy_settings, tiny_dir) as server:
        async with LoomClient(server.address, key) as client:
            _, want_text, want_ids, _ = await collect(client.generate_call(request))
            chunks = []
            killed_after = 0
            async for chunk in client.generate_call(request, timeout=180):
                chunks.append(chunk)
                delivered = sum(len(c.token_ids) for c in chunks)
                if not killed_after and delivered >= 20:
                    killed_after = delivered
                    os.kill((await fragile.model_info.remote())["pid"], signal.SIGKILL)
        assert killed_after
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == want_ids  # greedy: the continuation is exactly the uninterrupted stream
        assert "".join(c.text for c in chunks) == want_text
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == 300
        await eventually(lambda: _usage_requests(gateway, tenant.id, 2))
        usage = gateway.store.usage(tenant.id, days=1)[0]
        assert usage.completion_tokens == 600 and usage.errors == 0
        assert await engine_idle(fragile)


def _usage_requests(gateway: Gateway, tenant_id: str, n: int) -> bool:
    days = gateway.store.usage(tenant_id, days=1)
    return bool(days) and days[0].requests == n


async def _serves(client: LoomClient) -> bool:
    try:
        _, _, ids, _ = await collect(client.generate_call(req(max_tokens=2), timeout=10))
        return len(ids) == 2
    except grpc.aio.AioRpcError:
        return False


async def test_gateway_runs_as_a_serve_deployment(
    gateway: Gateway, tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    from ray import serve

    from gateway.serve_ingress import gateway_deployment

    port = _free_port()
    app = gateway_deployment(
        GatewaySettings(port=port, http_port=0, metrics_port=None),
        tenancy_settings,
        {"shared": engine_app(PoolSpec(name="shared", engine=_tiny_engine(tiny_dir)))},
        {"shared": str(tiny_dir)},
        runtime_env={"env_vars": {"LOOM_TENANCY_SECRET": SECRET}},
    )
    handle = await asyncio.to_thread(serve.run, app, name="gateway-in-serve", route_prefix=None)
    try:
        address = await handle.address.remote()
        assert address.endswith(f":{port}")
        _, key = await gateway.tenant()
        async with LoomClient(address, key) as client:
            await eventually(lambda: _serves(client), timeout_s=30)
            _, _, ids, last = await collect(client.generate_call(req(max_tokens=5)))
            models = await client.list_models()
        assert len(ids) == 5 == last.usage.completion_tokens
        assert [m.id for m in models] == [TINY]
    finally:
        await asyncio.to_thread(serve.delete, "gateway-in-serve")


@pytest.fixture(scope="module")
def pair(ray_serve: None, tiny_dir: Path) -> Any:
    """Two replicas of one engine deployment, routed by Loom's request router."""
    from ray import serve

    spec = PoolSpec(name="shared", replicas=2, engine=_tiny_engine(tiny_dir, max_num_seqs=8))
    handle = serve.run(engine_app(spec), name="engine-pair", route_prefix=None)
    yield handle
    serve.delete("engine-pair")


async def test_router_keeps_a_prefix_on_one_replica_and_spreads_load(
    gateway: Gateway, pair: Any, tenancy_settings: TenancySettings, tiny_dir: Path
) -> None:
    from worker.api import process_registry

    (_, key_a), (_, key_b) = await gateway.tenant(), await gateway.tenant()
    prompt = "A shared system prompt that many requests of this tenant start with. " * 2
    async with private_gateway(pair, tenancy_settings, tiny_dir) as server:
        async with LoomClient(server.address, key_a) as a, LoomClient(server.address, key_b) as b:
            first = (await collect(a.generate_call(req(prompt=prompt, max_tokens=2))))[3]
            repeats = [
                (await collect(a.generate_call(req(prompt=prompt, max_tokens=2))))[3] for _ in range(5)
            ]
            # A burst of unrelated work from another tenant lands on both replicas.
            await asyncio.gather(
                *(collect(b.generate_call(req(prompt=f"job {i} " * 20, max_tokens=60))) for i in range(16))
            )
        assert first.usage.cached_prompt_tokens == 0
        # Same tenant, same prefix: every repeat found the prefix on the replica that computed it.
        assert all(r.usage.cached_prompt_tokens >= first.usage.prompt_tokens - 8 for r in repeats)

        def both_served() -> bool:
            stats = process_registry().replicas("engine-pair/engine-shared")
            return len(stats) == 2 and all(s.finished_requests > 0 for s in stats.values())

        await eventually(both_served, timeout_s=15)
