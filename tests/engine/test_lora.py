"""LoRA adapters: greedy tokens equal transformers + peft on the same adapters, mixed in one batch and
alone; adapters are made here with peft (random, non-zero B), saved in the PEFT format."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.adapters import AdapterError, LoraRequest, inspect_adapter
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, GenerationRequest, SamplingParams
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine

MAX_TOKENS = 16
ADAPTERS: dict[str, dict[str, Any]] = {
    "attn": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "every": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
    "mlp": {
        "r": 16,
        "lora_alpha": 16,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "use_rslora": True,
    },
}


def _greedy(model: Any, ids: list[int], eos: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return y[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def adapters(
    smollm: Checkpoint, hf_model: Any, prompt_ids: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Each adapter's directory and transformers+peft's greedy tokens for two prompts."""
    from peft import LoraConfig, get_peft_model

    eos = list(smollm.tokenizer.eos_token_ids)
    out: dict[str, Any] = {"base": {"ref": [_greedy(hf_model, ids, eos) for ids in prompt_ids[:2]]}}
    for name, cfg in ADAPTERS.items():
        torch.manual_seed(len(name))
        model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **cfg)).eval()
        path = tmp_path_factory.mktemp("adapters") / name
        model.save_pretrained(str(path))
        out[name] = {"path": path, "ref": [_greedy(model, ids, eos) for ids in prompt_ids[:2]]}
        del model
    return out


def _request(
    rid: str, ids: list[int], adapter: str | None, adapters: dict[str, Any], speculative: bool = False
) -> GenerationRequest:
    lora = LoraRequest(f"t/{adapter}", str(adapters[adapter]["path"])) if adapter else None
    return GenerationRequest(
        rid, ids, SamplingParams(max_tokens=MAX_TOKENS), adapter=lora, speculative=speculative
    )


def test_adapters_change_the_output(adapters: dict[str, Any]) -> None:
    for name in ADAPTERS:
        assert adapters[name]["ref"] != adapters["base"]["ref"], name


def test_mixed_batch_equals_transformers_with_peft(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any]
) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=256, max_loras=3), smollm)
    names = [None, *ADAPTERS]
    requests = [_request(f"{n}-{i}", prompt_ids[i], n, adapters) for n in names for i in range(2)]
    out = engine.run_to_completion(requests)  # all of them admitted at once: mixed batches
    for n in names:
        for i in range(2):
            assert out[f"{n}-{i}"].token_ids == adapters[n or "base"]["ref"][i], (n, i)
    assert engine.block_manager.num_used_blocks == 0
    assert set(engine.stats().loaded_adapters) == {f"t/{n}" for n in ADAPTERS}


def test_speculation_verifies_with_the_adapter(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any]
) -> None:
    """Proposals are verified by the adapted model, so the tokens are the adapter's own."""
    engine = LLMEngine(EngineConfig(num_blocks=256, max_loras=3), smollm)
    names = [None, *ADAPTERS]
    requests = [_request(f"{n}-{i}", prompt_ids[i], n, adapters, True) for n in names for i in range(2)]
    out = engine.run_to_completion(requests)
    for n in names:
        for i in range(2):
            assert out[f"{n}-{i}"].token_ids == adapters[n or "base"]["ref"][i], (n, i)
    assert sum(c.draft_tokens for c in engine.stats().speculation.values()) > 0


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_alone_equals_transformers_with_peft(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any], name: str
) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=128, max_loras=1), smollm)
    out = engine.run_to_completion([_request("a", prompt_ids[0], name, adapters)])
    assert out["a"].token_ids == adapters[name]["ref"][0]


def test_more_adapters_than_slots_wait_their_turn_and_evict_lru(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any]
) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=256, max_loras=1), smollm)
    requests = [_request(f"{n}", prompt_ids[1], n, adapters) for n in ADAPTERS]
    out = engine.run_to_completion(requests)  # one slot: they run one adapter after another
    for n in ADAPTERS:
        assert out[n].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert out[n].token_ids == adapters[n]["ref"][1]
    assert len(engine.stats().loaded_adapters) == 1


def test_a_base_prefix_and_an_adapter_prefix_never_share_blocks(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any]
) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=256, max_loras=2), smollm)
    long = prompt_ids[5] * 3
    engine.run_to_completion([_request("base", long, None, adapters)])
    hits = engine.stats().prefix_cache_hits
    adapted = engine.run_to_completion([_request("lora", long, "attn", adapters)])
    assert engine.stats().prefix_cache_hits == hits  # the adapter found none of the base's blocks
    again = engine.run_to_completion([_request("lora2", long, "attn", adapters)])
    assert engine.stats().prefix_cache_hits > hits  # but its own
    assert again["lora2"].token_ids == adapted["lora"].token_ids


def test_an_unreadable_adapter_fails_its_request_only(
    smollm: Checkpoint, prompt_ids: list[list[int]], adapters: dict[str, Any], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    engine = LLMEngine(EngineConfig(num_blocks=128, max_loras=2), smollm)
    requests = [
        GenerationRequest(
            "bad", prompt_ids[0], SamplingParams(max_tokens=4), adapter=LoraRequest("t/x", str(broken))
        ),
        _request("good", prompt_ids[0], None, adapters),
    ]
    out = engine.run_to_completion(requests)
    assert out["bad"].finish_reason is FinishReason.ERROR and "adapter could not be loaded" in (
        out["bad"].error or ""
    )
    assert out["good"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_inspection_refuses_what_does_not_fit(
    smollm: Checkpoint, adapters: dict[str, Any], tmp_path: Path
) -> None:
    info = inspect_adapter(adapters["every"]["path"], smollm.config)
    assert info.rank == 8 and len(info.targets) == 7 and len(info.digest) == 16
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        inspect_adapter(tmp_path, smollm.config)
    small = copy.deepcopy(smollm.config)
    object.__setattr__(small, "hidden_size", 64)
    with pytest.raises(AdapterError, match="does not fit this base model"):
        inspect_adapter(adapters["attn"]["path"], small)
    with pytest.raises(AdapterError, match=r"rank r=8 is outside 1\.\.4"):
        inspect_adapter(adapters["every"]["path"], smollm.config, max_rank=4)
