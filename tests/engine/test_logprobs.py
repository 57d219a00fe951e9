"""Log-probabilities the engine returns equal transformers' on the same weights."""

from __future__ import annotations

from typing import Any

import torch

from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from tests.engine.conftest import PROMPTS
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine


def test_logprobs_match_transformers_for_greedy_and_sampled_tokens(smollm: Checkpoint, hf_model: Any) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=128), smollm)
    chat = [{"role": "user", "content": PROMPTS[1]}]
    prompt = smollm.tokenizer.encode_chat(chat)
    requests = [
        GenerationRequest("greedy", prompt, SamplingParams(max_tokens=12, logprobs=5, ignore_eos=True)),
        GenerationRequest(
            "sampled",
            prompt,
            SamplingParams(max_tokens=12, logprobs=2, temperature=1.0, seed=7, ignore_eos=True),
        ),
        GenerationRequest("plain", prompt, SamplingParams(max_tokens=12, ignore_eos=True)),
    ]
    out = engine.run_to_completion(requests)
    assert out["plain"].logprobs is None
    for rid, k in (("greedy", 5), ("sampled", 2)):
        o = out[rid]
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) == 12
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + o.token_ids])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # position i predicts token i
        for i, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
            assert lp.token_id == tok
            assert abs(lp.logprob - ref[i, tok].item()) < 2e-3
            assert len(lp.top) == k
            best = torch.topk(ref[i], k)
            assert [t for t, _ in lp.top] == best.indices.tolist()
            assert max(abs(v - r) for (_, v), r in zip(lp.top, best.values.tolist(), strict=True)) < 2e-3
        if rid == "greedy":  # a greedy token is the most likely one
            assert all(lp.top[0][0] == lp.token_id for lp in o.logprobs)
