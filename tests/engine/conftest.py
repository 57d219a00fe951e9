"""Engine fixtures: the embedded SmolLM2 checkpoint and its Hugging Face reference, loaded once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loadtest.bench_engine import REFERENCE_PROMPTS
from loadtest.tiny_model import random_checkpoint
from worker.checkpoint import Checkpoint, load_checkpoint

torch.set_num_threads(2)

# Eight chat prompts of varied length and topic (the engine benchmark's reference prompts); the
# reference tokens come from transformers.
PROMPTS = REFERENCE_PROMPTS
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def smollm() -> Checkpoint:
    return load_checkpoint()


@pytest.fixture(scope="session")
def prompt_ids(smollm: Checkpoint) -> list[list[int]]:
    return [smollm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_model(smollm: Checkpoint) -> object:
    """transformers' LlamaForCausalLM on the same dequantized weights: the reference."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**smollm.config.to_hf_dict())
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(smollm.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.fixture(scope="session")
def hf_reference(smollm: Checkpoint, prompt_ids: list[list[int]], hf_model: Any) -> list[list[int]]:
    """Greedy continuations from transformers' LlamaForCausalLM on the same dequantized weights."""
    model = hf_model
    eos = list(smollm.tokenizer.eos_token_ids)
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny() -> Checkpoint:
    return random_checkpoint()
