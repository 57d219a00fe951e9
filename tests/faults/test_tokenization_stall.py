"""Prompts at the 1 MB limit are tokenized without stalling the gateway's event loop.

The gateway tokenizes a large prompt in a worker thread; that only helps if the tokenizer lets go of
the GIL, which HF tokenizers' ``encode`` does not (it held the loop for the whole second a 1 MB prompt
takes: every stream of every tenant stopped, and Redis calls timed out into fail-static mode).
loadtest/bench_isolation.py measures the effect on another tenant's token gaps; this holds the fix.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gateway.grpc.client import LoomClient
from gateway.grpc.stubs import pb
from gateway.settings import GatewaySettings
from protocol.engine_config import EngineConfig
from protocol.limits import LIMITS
from protocol.tokenizer import Tokenizer
from serving.bootstrap import PoolRoute, start_gateway
from serving.pools import LocalEnginePool
from tenancy import FileTenantStore, TenancySettings
from tenancy.models import Quotas, Tenant
from worker.api import AsyncEngine, LLMEngine


@pytest.fixture
async def served(model_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """An in-process gateway (engine in this process too: no Ray needed) and a tenant's key."""
    engine = AsyncEngine(
        LLMEngine(EngineConfig(model_path=str(model_dir), kv_cache_memory_mb=8, num_threads=1))
    )
    engine.start()
    settings = TenancySettings(
        store="file", tenants_file=tmp_path / "tenants.yaml", secret="stall-test-secret-0123456789"
    )
    store = FileTenantStore(settings.tenants_file, settings.hasher())
    store.create_tenant(Tenant(id="big", quotas=Quotas.unlimited()), actor="tests")
    key = store.create_key("big", actor="tests").plaintext.get_secret_value()
    gateway = await start_gateway(
        GatewaySettings(port=0, http_port=None, metrics_port=None),
        settings,
        [PoolRoute(LocalEnginePool(engine), model_dir)],
    )
    try:
        yield gateway.server.address, key
    finally:
        await gateway.stop(grace_s=0)
        engine.shutdown()


async def test_one_megabyte_prompts_do_not_stall_the_event_loop(
    served: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, key = served
    # No size floor: these prompts must be tokenized (the gateway refuses one whose bytes alone prove
    # it too long before tokenizing it, which would leave nothing to measure here).
    monkeypatch.setattr(Tokenizer, "max_token_bytes", property(lambda _: LIMITS.max_prompt_bytes))
    rng = random.Random(0)
    prompt = "".join(rng.choice(string.ascii_letters + " .,") for _ in range(LIMITS.max_prompt_bytes))
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def big(client: LoomClient, messages: bool) -> grpc.StatusCode:
        request = pb.GenerateRequest(model="tiny", max_tokens=1)
        if messages:
            request.messages.add(role="user", content=prompt[:-64])
        else:
            request.prompt = prompt
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in client.generate_call(request, timeout=120):
                pass
        return refused.value.code()

    async with LoomClient(address, key) as client:
        tick = asyncio.create_task(ticker())
        started = time.perf_counter()
        codes = await asyncio.gather(*(big(client, messages=i % 2 == 1) for i in range(4)))
        elapsed = time.perf_counter() - started
        done.set()
        await tick
    # Tokenized (seconds of work), then refused: a million tokens leave no room in the context.
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    # The loop kept turning: no stall near the length of a tokenization (about a second each).
    assert max(gaps) < 0.25 * elapsed, (max(gaps), elapsed)
