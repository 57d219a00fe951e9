"""A few seconds of ``loom loadtest`` against a real served Loom: the gateway in this process over a
loopback socket, an in-process engine (a tiny random-weight model) behind it, the embedded file
tenant store. No Ray: the point is the load generator's whole path (workload file, plan, gRPC
streams, refusals by code, metrics scrape, report files), not the Serve deployment, which the
gateway tests cover."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gateway.catalog import ModelCatalog
from gateway.pools import LocalEnginePool
from gateway.server import GatewayServer
from gateway.settings import GatewaySettings
from loadtest.tiny_model import random_checkpoint, save_hf_dir
from loom.cli import build_parser
from tenancy import FileTenantStore, Tenancy, TenancySettings
from tenancy.models import Quotas, Tenant
from worker.api import AsyncEngine, EngineConfig, LLMEngine, load_tokenizer


@dataclass
class Served:
    address: str
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
    tenancy = Tenancy.from_settings(settings)
    await tenancy.start()
    pool = LocalEnginePool(engine)
    model = (await pool.describe()).model
    catalog = await ModelCatalog.build([(pool, load_tokenizer(model_dir))])
    server = await GatewayServer(
        GatewaySettings(port=0, http_port=0, metrics_port=0), tenancy, catalog
    ).start()
    try:
        yield Served(server.address, f"http://127.0.0.1:{server.metrics_port}/metrics", model, keys)
    finally:
        await server.stop(grace_s=0)
        await tenancy.stop()
        engine.shutdown()


def _workload(path: Path, served: Served, **extra: object) -> Path:
    data = {
        "name": "smoke",
        "target": {"address": served.address, "model": served.model, "metrics_url": served.metrics_url},
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
        [str(wl), "--api-key", f"globex={served.keys['globex']}", "--out", str(out), "--quiet"]
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
    md = (out / "report.md").read_text()
    assert "| acme |" in md and "UNAUTHENTICATED" in md


async def test_loadtest_rate_sweep_writes_the_knee(served: Served, tmp_path: Path) -> None:
    wl = _workload(
        tmp_path / "sweep.yaml",
        served,
        arrival={"process": "sweep", "rates": [2, 5], "stage_s": 1.5},
        tenants=[{"name": "acme", "api_key": served.keys["acme"]}],
    )
    out = tmp_path / "sweep"
    assert await _loadtest([str(wl), "--out", str(out), "--quiet", "--metrics-url", "none"]) == 0
    rep = json.loads((out / "report.json").read_text())
    points = rep["sweep"]["points"]
    assert [p["offered_rps"] for p in points] == [2, 5]
    assert all(p["ttft_p50_s"] not in (None, "inf") for p in points)
    assert (out / "knee.png").exists()


async def test_loadtest_refuses_a_remote_target(served: Served, tmp_path: Path) -> None:
    wl = _workload(tmp_path / "remote.yaml", served)
    assert await _loadtest([str(wl), "--address", "10.1.2.3:50051", "--quiet"]) == 2
