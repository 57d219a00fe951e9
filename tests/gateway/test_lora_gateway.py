"""LoRA adapters through the served system: a tenant's adapter is its own model, over gRPC and HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from gateway.grpc.stubs import pb
from gateway.metrics import ENGINE
from loadtest.tiny_model import random_checkpoint, save_random_adapter
from protocol.adapters import LoraRequest, inspect_adapter
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from tenancy import AdapterRecord
from tests.gateway.conftest import TINY, Gateway, eventually
from tests.gateway.test_gateway_e2e import collect
from worker.api import LLMEngine, load_checkpoint


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_adapter(
        random_checkpoint().config, tmp_path_factory.mktemp("adapters") / "mine", rank=8, magnitude=4.0
    )


async def _tenant_with_adapter(
    gateway: Gateway, adapter_dir: Path, tiny_dir: Path
) -> tuple[Any, str, AdapterRecord]:
    info = inspect_adapter(adapter_dir, load_checkpoint(tiny_dir).config)
    record = AdapterRecord(
        base_model=TINY, path=str(adapter_dir), digest=info.digest, rank=info.rank, targets=info.targets
    )
    tenant, key = await gateway.tenant()
    gateway.store.update_tenant(
        tenant.id, {"adapters": {"mine": record.model_dump(mode="json")}}, actor="tests"
    )
    await eventually(lambda: "mine" in gateway.tenancy.authenticate(key).tenant.adapters, timeout_s=20)
    return tenant, key, record


async def test_a_tenants_adapter_is_its_own_model(
    gateway: Gateway, adapter_dir: Path, tiny_dir: Path
) -> None:
    tenant, key, record = await _tenant_with_adapter(gateway, adapter_dir, tiny_dir)
    request = pb.GenerateRequest(model=f"{TINY}:mine", prompt="hello loom", max_tokens=12, temperature=0.0)
    async with gateway.client(key) as client:
        _, _, ids, _ = await collect(client.generate_call(request))
        base = await collect(
            client.generate_call(
                pb.GenerateRequest(model=TINY, prompt="hello loom", max_tokens=12, temperature=0.0)
            )
        )
        models = [m.id for m in await client.list_models()]
    assert f"{TINY}:mine" in models
    # The served adapter's tokens are the in-process engine's with the same adapter, and not the base's.
    engine = LLMEngine(EngineConfig(num_blocks=64), load_checkpoint(tiny_dir))
    lora = LoraRequest(record.engine_id(tenant.id, "mine"), str(adapter_dir))
    prompt = engine.tokenizer.encode("hello loom")
    want = engine.run_to_completion(
        [GenerationRequest("x", prompt, SamplingParams(max_tokens=12), adapter=lora)]
    )
    assert ids == want["x"].token_ids
    assert ids != base[2]
    # The replica keeps it in a slot (the router prefers it for this adapter) and reports its slots in
    # vLLM's shape, for inference-aware routers.
    stats = await gateway.handles["tiny"].stats.remote()
    assert record.engine_id(tenant.id, "mine") in stats.loaded_adapters
    rows = [s for m in ENGINE.collect() if m.name == "loom:lora_requests_info" for s in m.samples]
    assert any(s.labels["max_lora"] == str(stats.max_loras) for s in rows)


async def test_another_tenants_adapter_is_indistinguishable_from_a_missing_one(
    gateway: Gateway, adapter_dir: Path, tiny_dir: Path
) -> None:
    await _tenant_with_adapter(gateway, adapter_dir, tiny_dir)
    _, other = await gateway.tenant()
    async with gateway.client(other) as client:
        errors = []
        for model in (f"{TINY}:mine", f"{TINY}:nothing-here"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(
                    client.generate_call(pb.GenerateRequest(model=model, prompt="hi", max_tokens=2))
                )
            errors.append(info.value)
        models = [m.id for m in await client.list_models()]
    assert [e.code() for e in errors] == [grpc.StatusCode.NOT_FOUND] * 2
    assert errors[0].details().replace(f"{TINY}:mine", "X") == errors[1].details().replace(
        f"{TINY}:nothing-here", "X"
    )
    assert not any(":" in m for m in models)
    with pytest.raises(openai.NotFoundError):
        await gateway.openai(other).completions.create(model=f"{TINY}:mine", prompt="hi", max_tokens=2)
