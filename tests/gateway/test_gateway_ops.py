"""Operating the gateway: health, reflection, metrics, drain, TLS, a killed worker, the Serve-deployed
gateway (the KubeRay shape)."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from common import Priority
from gateway.grpc.client import LoomClient
from gateway.grpc.stubs import SERVICE_NAME, pb
from gateway.settings import GatewaySettings
from serving.app import PoolSpec, engine_app
from serving.ledger import pool_ledger
from tenancy import TenancySettings
from tests.gateway.conftest import (
    SECRET,
    SMOL,
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
    tenant, key = await gateway.tenant(kv_floor=0.25, kv_cap=0.5)
    async with gateway.client(key) as client:
        await collect(client.generate_call(req(max_tokens=4)))
    port = gateway.server.metrics_port
    assert port

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    await eventually(lambda: "loom:kv_cache_usage_perc{" in scrape())
    await eventually(lambda: f'tenant="{tenant.id}"' in scrape().split("loom:kv_cache_blocks_held", 1)[-1])
    text = scrape()
    assert f'loom:gateway_requests_total{{code="OK",priority="standard",tenant="{tenant.id}"}} 1.0' in text
    assert f'loom:generation_tokens_total{{tenant="{tenant.id}"}} 4.0' in text
    assert 'loom:num_requests_running{model="tiny",pool="shared"' in text
    assert 'loom:num_requests_waiting{model="tiny",pool="shared",priority="batch"' in text
    assert "loom:time_to_first_token_seconds_bucket" in text
    assert 'loom:tenancy_quota_mode{mode="redis"} 1.0' in text
    # The tenant's KV share reached the replica that served it (the gateway sets it, never the client).
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    totals = {_replica(s.labels): s.value for s in samples if s.name == "loom:kv_cache_blocks_total"}
    shares = [s for s in samples if s.name == "loom:kv_cache_blocks_held" and s.labels["tenant"] == tenant.id]
    assert {s.labels["kind"] for s in shares} == {"held", "floor", "cap"}
    for s in shares:
        fraction = {"floor": 0.25, "cap": 0.5}.get(s.labels["kind"])
        if fraction is not None:
            assert s.value == int(fraction * totals[_replica(s.labels)])


async def test_speculation_is_opted_into_by_tenant_or_request_and_counted_per_tenant(
    gateway: Gateway,
) -> None:
    """A tenant set to speculate does, unless its request says otherwise; a request may opt in on its
    own; the spec-decode counters say per tenant what was proposed and accepted."""
    by_tenant, key_on = await gateway.tenant(speculative=True)
    declined, key_declined = await gateway.tenant(speculative=True)
    by_request, key_off = await gateway.tenant()
    repetitive = "a b c d e f g h " * 6 + "a b c"  # the model goes on with the pattern
    for key, flag in ((key_on, None), (key_declined, False), (key_off, True)):
        extra = {} if flag is None else {"speculative": flag}
        async with gateway.client(key) as client:
            await collect(
                client.generate_call(
                    req(model=SMOL, prompt=repetitive, max_tokens=8, temperature=0.0, **extra)
                )
            )
    port = gateway.server.metrics_port

    def drafts() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        out: dict[str, float] = {}
        for s in samples:
            if s.name == "loom:spec_decode_num_drafts_total":
                out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
        return out

    await eventually(lambda: {by_tenant.id, by_request.id} <= set(drafts()))
    counts = drafts()
    assert counts[by_tenant.id] >= 1 and counts[by_request.id] >= 1
    assert declined.id not in counts


async def test_replicas_share_their_service_through_the_pools_ledger(gateway: Gateway) -> None:
    """A tenant served by a replica shows in its deployment's ledger within a few seconds: what every
    other replica of the pool adds to its fair-share counters."""
    tenant, key = await gateway.tenant()
    async with gateway.client(key) as client:
        await collect(client.generate_call(req(max_tokens=4)))
    ledger = pool_ledger("engine-tiny/engine-shared")
    seen: dict[tuple[Priority, str], float] = {}

    async def served() -> bool:
        seen.update(await ledger.report.remote("a-probe", {}))
        return (Priority.STANDARD, tenant.id) in seen

    await eventually(served, interval_s=0.2)
    assert seen[(Priority.STANDARD, tenant.id)] > 0


def _replica(labels: dict[str, str]) -> tuple[str, ...]:
    return tuple(v for k, v in sorted(labels.items()) if k not in ("tenant", "kind"))


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


def _openssl(command: str) -> None:
    subprocess.run(["openssl", *command.split()], check=True, capture_output=True)


def make_pki(d: Path, ca: str = "loom-test-ca", names: tuple[str, ...] = ("server", "client")) -> Path:
    """In ``d`` (a path without spaces): a CA (ca.pem, ca.key) and, per name, a certificate it signed
    for 127.0.0.1/localhost."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl(f"req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN={ca} -keyout {d}/ca.key -out {d}/ca.pem")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in names:
        _openssl(f"req -newkey rsa:2048 -nodes -subj /CN={name} -keyout {d}/{name}.key -out {d}/{name}.csr")
        _openssl(
            f"x509 -req -in {d}/{name}.csr -CA {d}/ca.pem -CAkey {d}/ca.key -CAcreateserial"
            f" -extfile {d}/san.ext -days 2 -out {d}/{name}.pem"
        )
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


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


def _https_health(port: int, ca: Path) -> int:
    """GET /health on a new TLS connection that trusts only ``ca`` (ssl.SSLError if the server's
    certificate is not from it)."""
    connection = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(cafile=str(ca)), timeout=5
    )
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()


async def test_a_renewed_certificate_is_served_without_a_restart(
    gateway: Gateway, tenancy_settings: TenancySettings, tiny_dir: Path, tmp_path: Path
) -> None:
    old = make_pki(tmp_path / "old", "old-ca", ("server",))
    new = make_pki(tmp_path / "new", "new-ca", ("server",))
    live = tmp_path / "live"
    live.mkdir()

    def install(cert: Path, key: Path) -> None:
        """Replace each mounted file whole, one after the other, as a non-atomic writer would."""
        for source, name in ((cert, "tls.crt"), (key, "tls.key")):
            shutil.copy(source, live / f".{name}")
            os.replace(live / f".{name}", live / name)

    def rejected() -> float:
        return REGISTRY.get_sample_value("loom:gateway_tls_reloads_total", {"outcome": "rejected"}) or 0.0

    install(old / "server.pem", old / "server.key")
    server, tenancy = await start_gateway(
        gateway.handles,
        tenancy_settings,
        tiny_dir,
        tls_cert_file=str(live / "tls.crt"),
        tls_key_file=str(live / "tls.key"),
        tls_reload_interval_s=0.05,
    )
    _, key = await gateway.tenant()
    https_port = server.http.port
    assert https_port

    async def served_by(ca: Path) -> bool:
        """Whether a new gRPC connection that trusts only ``ca`` completes a call."""
        try:
            async with LoomClient(server.address, key, root_certificates=ca.read_bytes()) as client:
                _, _, ids, _ = await collect(client.generate_call(req(max_tokens=2), timeout=5))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            return False
        return len(ids) == 2

    try:
        assert await served_by(old / "ca.pem") and not await served_by(new / "ca.pem")
        assert await asyncio.to_thread(_https_health, https_port, old / "ca.pem") == 200
        async with LoomClient(server.address, key, root_certificates=(old / "ca.pem").read_bytes()) as kept:
            await collect(kept.generate_call(req(max_tokens=2)))  # connected under the old certificate
            # Half a renewal (the new certificate beside the old key) is refused; the old pair stays.
            before = rejected()
            install(new / "server.pem", old / "server.key")
            await eventually(lambda: rejected() > before)
            assert await served_by(old / "ca.pem")
            install(new / "server.pem", new / "server.key")
            await eventually(lambda: served_by(new / "ca.pem"))
            assert not await served_by(old / "ca.pem")
            assert await asyncio.to_thread(_https_health, https_port, new / "ca.pem") == 200
            with pytest.raises(ssl.SSLError):
                await asyncio.to_thread(_https_health, https_port, old / "ca.pem")
            _, _, ids, _ = await collect(kept.generate_call(req(max_tokens=2)))
            assert len(ids) == 2  # the connection opened before the renewal carries on
        want_expiry = x509.load_pem_x509_certificate((new / "server.pem").read_bytes()).not_valid_after_utc
        expiry = REGISTRY.get_sample_value("loom:gateway_tls_certificate_expiry_timestamp_seconds")
        assert expiry == want_expiry.timestamp()
    finally:
        await server.stop(grace_s=0)
        await tenancy.stop()


@pytest.fixture(scope="module")
def fragile(ray_serve: None, tiny_dir: Path) -> Any:
    from ray import serve

    # Deltas of 3 tokens after the first (stream_interval): held tokens lost with the replica must be
    # made again by the resumed request, and usage must count only what was shipped.
    spec = PoolSpec(name="shared", engine=_tiny_engine(tiny_dir, stream_interval=3))
    handle = serve.run(engine_app(spec), name="engine-fragile", route_prefix=None)
    yield handle
    serve.delete("engine-fragile")


async def test_stream_survives_a_killed_worker(
    gateway: Gateway,
    fragile: Any,
    tenancy_settings: TenancySettings,
    tiny_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.resume")
    tenant, key = await gateway.tenant(quotas={"max_concurrent": 1})
    # 900 tokens: the replica is still generating when a slow client has read 20 and killed it.
    request = req(prompt="the replica may die", max_tokens=900, temperature=0.0, stop=[])
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
                    os.kill((await fragile.model_info.remote()).pid, signal.SIGKILL)
        assert killed_after
        assert any("resuming" in rec.getMessage() for rec in caplog.records), "the stream was not resumed"
        sizes = [len(c.token_ids) for c in chunks]
        assert sizes[0] == 1 and max(sizes) == 3  # the first token at once, then groups of three
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == want_ids  # greedy: the continuation is exactly the uninterrupted stream
        assert "".join(c.text for c in chunks) == want_text
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == 900
        await eventually(lambda: _usage_requests(gateway, tenant.id, 2))
        usage = gateway.store.usage(tenant.id, days=1)[0]
        assert usage.completion_tokens == 1800 and usage.errors == 0
        await eventually(lambda: engine_idle(fragile), timeout_s=60)


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

    from serving.ingress import gateway_deployment

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
    from serving.replica_stats import process_registry

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
