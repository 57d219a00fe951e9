"""A few seconds of ``loom loadtest`` against a real served Loom: the gateway in this process over
loopback sockets (gRPC and the OpenAI-compatible HTTP front), an in-process engine (a tiny
random-weight model) behind it, the embedded file tenant store. No Ray: the point is the load
generator's whole path (workload file, plan, gRPC and HTTP streams, refusals by code, metrics scrape,
utilization from the engine's counters, report files), not the Serve deployment, which the gateway
tests cover."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from common import Priority
from gateway.settings import GatewaySettings
from loadtest.cli import build_parser
from loadtest.driver import DriverError, DriverRequest, GrpcDriver, HttpDriver
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from protocol.engine_config import EngineConfig
from serving.bootstrap import PoolRoute, start_gateway
from serving.pools import LocalEnginePool
from tenancy import FileTenantStore, TenancySettings
from tenancy.models import Quotas, Tenant
from worker.api import AsyncEngine, LLMEngine


@dataclass
class Served:
    address: str
    http_address: str
    metrics_url: str
    model: str
    keys: dict[str, str]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    model_dir = save_hf_dir(random_checkpoint(), tmp_path / "tiny")
    engine = AsyncEngine(
        LLMEngine(
            EngineConfig(
                model_path=str(model_dir), block_size=8, kv_cache_memory_mb=8, max_num_seqs=8, num_threads=1
            )
        )
    ).start()
    settings = TenancySettings(
        store="file",
        tenants_file=tmp_path / "tenants.yaml",
        secret="loadtest-smoke-secret-0123456789abcdef",
        file_poll_interval_s=0.2,
    )
    store = FileTenantStore(settings.tenants_file, settings.hasher())
    keys = {}
    for name in ("acme", "globex"):
        store.create_tenant(Tenant(id=name, quotas=Quotas.unlimited()), actor="tests")
        keys[name] = store.create_key(name, actor="tests").plaintext.get_secret_value()
    pool = LocalEnginePool(engine)
    model = (await pool.describe()).model
    gateway = await start_gateway(
        GatewaySettings(port=0, http_port=0, metrics_port=0), settings, [PoolRoute(pool, model_dir)]
    )
    server = gateway.server
    try:
        assert server.http_address is not None
        yield Served(
            server.address,
            server.http_address,
            f"http://127.0.0.1:{server.metrics_port}/metrics",
            model,
            keys,
        )
    finally:
        await gateway.stop(grace_s=0)
        engine.shutdown()


def _workload(path: Path, served: Served, **extra: object) -> Path:
    data = {
        "name": "smoke",
        "target": {
            "address": served.address,
            "http_address": served.http_address,
            "model": served.model,
            "metrics_url": served.metrics_url,
        },
        "seed": 3,
        "duration_s": 3.0,
        "max_requests": 60,
        "max_seconds": 30,
        "drain_s": 10,
        "arrival": {"process": "poisson", "rate": 6},
        "priorities": {"interactive": 1, "batch": 1},
        "prompt": {"dist": "uniform", "min": 2, "max": 6},
        "output": {"dist": "lognormal", "median": 6, "sigma": 0.8, "min": 2, "max": 16},
        "tenants": [
            {"name": "acme", "api_key_env": "LOOM_SMOKE_ACME", "share": 2},
            {"name": "globex"},
            {"name": "stranger", "api_key": "loom_not_a_real_key", "share": 0.5},
        ],
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def _assert_utilization(stage: dict[str, Any], copy_bandwidth_gbs: float | None) -> dict[str, Any]:
    """The engine's utilization over the stage, from its counters: present and sane. The engine is
    continuous and never preempts here (8 slots, a cache that holds them), so every token computed is
    useful."""
    u = stage["utilization"]
    # This gateway's in-process engine; gateways of other tests in this process (Serve pools) may
    # report their replicas on the same /metrics.
    (name,) = [n for n in u["replicas"] if n.endswith("/local")]
    assert not any(n.endswith("/local") for n in u["skipped"])
    f = u["replicas"][name]
    assert f["scrapes"] >= 2 and f["wall_s"] > 0 and f["restarts"] == 0
    assert 0 < f["busy_fraction"] <= 1
    assert 0 < f["slot_occupancy"] <= 1
    assert f["useful_token_fraction"] == 1
    assert f["recomputed_tokens"] == 0 and f["computed_tokens"] > 0
    assert 0 <= f["kv_blocks_in_use"] <= f["kv_blocks_in_use_max"] <= 1
    assert f["steps_per_s"] > 0 and f["mean_step_s"] > 0
    # Busy and wall figures differ by the busy fraction; its raw value may pass 1 on a loaded machine
    # (a step's seconds count when it ends, the scrape's wall clock when it is taken), so no ordering.
    assert f["gb_per_s_wall"] > 0
    assert f["gb_per_s_busy"] * f["busy_fraction_raw"] == pytest.approx(f["gb_per_s_wall"], rel=1e-3)
    if copy_bandwidth_gbs is None:
        assert f["mbu"] is None and f["mbu_wall"] is None
    else:
        assert f["mbu"] == pytest.approx(f["gb_per_s_busy"] / copy_bandwidth_gbs, rel=1e-3)
        assert f["mbu_wall"] > 0
        assert f["mbu_wall"] == pytest.approx(f["mbu"] * f["busy_fraction_raw"], rel=1e-3)
    return f


async def _loadtest(argv: list[str]) -> int:
    args = build_parser().parse_args(["loadtest", *argv])
    # The CLI runs its own event loop (asyncio.run): give it a thread, this loop keeps serving.
    return await asyncio.to_thread(args.func, args)


async def test_loadtest_against_a_served_loom(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_SMOKE_ACME", served.keys["acme"])
    wl = _workload(tmp_path / "smoke.yaml", served)
    out = tmp_path / "report"
    code = await _loadtest(
        [
            str(wl),
            *("--api-key", f"globex={served.keys['globex']}"),
            *("--out", str(out), "--quiet", "--copy-bandwidth-gbs", "20"),
        ]
    )
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "latency.png"}
    stats = rep["stages"][0]["stats"]
    overall = stats["overall"]
    assert overall["requests"] == rep["plan"]["requests"] > 5
    # The stranger's bad key is refused by code; the real tenants' requests all stream to the end.
    assert stats["tenants"]["stranger"]["codes"] == {
        "UNAUTHENTICATED": stats["tenants"]["stranger"]["requests"]
    }
    for tenant in ("acme", "globex"):
        t = stats["tenants"][tenant]
        assert t["codes"] == {"OK": t["requests"]}
        assert t["ttft_s"]["p99"] not in (None, "inf")
        assert t["output_tokens"] > 0
    assert set(stats["priorities"]) == {"interactive", "batch"}
    assert 0 < overall["goodput_rps"] <= overall["requests"] / rep["stages"][0]["window_s"]
    # Engine gauges were scraped from the gateway's /metrics while the load ran.
    assert rep["metrics"]["samples"] > 0
    assert any(r.endswith("/local") for r in rep["stages"][0]["engine"])
    _assert_utilization(rep["stages"][0], copy_bandwidth_gbs=20.0)
    assert {r.get("front") for r in rep["requests"]} == {"grpc"}
    md = (out / "report.md").read_text()
    assert "| acme |" in md and "UNAUTHENTICATED" in md
    assert "Utilization over the window" in md and "copy bandwidth given (20 GB/s" in md


async def test_loadtest_through_the_http_front_beside_grpc(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stage with acme and the stranger on the HTTP front, globex on gRPC: the same codes, tokens
    counted chunk by chunk, and a per-front table."""
    monkeypatch.setenv("LOOM_SMOKE_ACME", served.keys["acme"])
    wl = _workload(
        tmp_path / "http.yaml",
        served,
        front="http",
        tenants=[
            {"name": "acme", "api_key_env": "LOOM_SMOKE_ACME", "share": 2},
            {"name": "globex", "api_key": served.keys["globex"], "front": "grpc"},
            {"name": "stranger", "api_key": "loom_not_a_real_key", "share": 0.5},
        ],
    )
    out = tmp_path / "http-report"
    assert await _loadtest([str(wl), "--out", str(out), "--quiet", "--no-plots"]) == 0
    rep = json.loads((out / "report.json").read_text())
    stats = rep["stages"][0]["stats"]
    assert stats["tenants"]["stranger"]["codes"] == {
        "UNAUTHENTICATED": stats["tenants"]["stranger"]["requests"]
    }
    for tenant in ("acme", "globex"):
        t = stats["tenants"][tenant]
        assert t["codes"] == {"OK": t["requests"]} and t["requests"] > 0
        assert t["ttft_s"]["p99"] not in (None, "inf") and t["itl_s"]["n"] > 0
    fronts = {r["tenant"]: r["front"] for r in rep["requests"]}
    assert fronts == {"acme": "http", "globex": "grpc", "stranger": "http"}
    assert set(stats["fronts"]) == {"grpc", "http"}
    # Every OK request over HTTP: the tokens counted from its chunks' logprobs are its usage's count.
    http_ok = [r for r in rep["requests"] if r["front"] == "http" and r["code"] == "OK"]
    assert http_ok and all(0 < r["completion_tokens"] <= r["max_tokens"] for r in http_ok)
    _assert_utilization(rep["stages"][0], copy_bandwidth_gbs=None)
    md = (out / "report.md").read_text()
    assert f"{served.http_address} (http)" in md and f"{served.address} (grpc)" in md
    assert "| front |" in md and "MBU is left empty" in md


async def test_grpc_and_http_drivers_see_the_same_tokens(served: Served) -> None:
    """The same greedy request through both fronts: one token per chunk, the same count, which is
    the usage's; and the same code names for the same refusals."""

    def req(**kw: Any) -> DriverRequest:
        fields: dict[str, Any] = {
            "request_id": f"parity-{uuid.uuid4().hex[:8]}",
            "tenant": "acme",
            "model": served.model,
            "prompt": "one two three four",
            "chat": False,
            "max_tokens": 12,
            "temperature": 0.0,
            "priority": Priority.INTERACTIVE,
            "seed": None,
            "timeout_s": 30.0,
        }
        return DriverRequest(**{**fields, **kw})

    keys = {"acme": served.keys["acme"], "nobody": "loom_not_a_real_key"}
    grpc_d, http_d = GrpcDriver(served.address, keys), HttpDriver(served.http_address, keys)
    try:
        for chat in (False, True):
            g = [c async for c in grpc_d.stream(req(chat=chat))]
            h = [c async for c in http_d.stream(req(chat=chat))]
            g_tokens = [c.tokens for c in g if c.tokens]
            h_tokens = [c.tokens for c in h if c.tokens]
            assert g_tokens == h_tokens and sum(h_tokens) > 0
            assert h[-1].completion_tokens == sum(h_tokens) == g[-1].completion_tokens
            assert {c.finish_reason for c in h} - {None} == {c.finish_reason for c in g} - {None}
        for bad, code in (
            (req(model="no-such-model"), "NOT_FOUND"),
            (req(tenant="nobody"), "UNAUTHENTICATED"),
            (req(max_tokens=0), "INVALID_ARGUMENT"),
        ):
            for d in (grpc_d, http_d):
                with pytest.raises(DriverError) as info:
                    [c async for c in d.stream(bad)]
                assert info.value.code == code, (d.name, info.value)
    finally:
        await grpc_d.close()
        await http_d.close()


async def test_loadtest_rate_sweep_writes_the_knee(served: Served, tmp_path: Path) -> None:
    wl = _workload(
        tmp_path / "sweep.yaml",
        served,
        arrival={"process": "sweep", "rates": [2, 5], "stage_s": 1.5},
        tenants=[{"name": "acme", "api_key": served.keys["acme"]}],
    )
    out = tmp_path / "sweep"
    argv = [str(wl), "--out", str(out), "--quiet", "--metrics-url", "none", "--front", "http"]
    assert await _loadtest(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert {r["front"] for r in rep["requests"]} == {"http"}
    assert all(st["utilization"]["replicas"] == {} for st in rep["stages"])  # nothing scraped
    points = rep["sweep"]["points"]
    assert [p["offered_rps"] for p in points] == [2, 5]
    assert all(p["ttft_p50_s"] not in (None, "inf") for p in points)
    assert (out / "knee.png").exists()


async def test_loadtest_refuses_a_remote_target(served: Served, tmp_path: Path) -> None:
    wl = _workload(tmp_path / "remote.yaml", served)
    assert await _loadtest([str(wl), "--address", "10.1.2.3:50051", "--quiet"]) == 2
    remote_http = ["--http-address", "10.1.2.3:8000", "--front", "http", "--quiet"]
    assert await _loadtest([str(wl), *remote_http]) == 2
