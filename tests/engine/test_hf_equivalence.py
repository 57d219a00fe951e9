"""The engine's greedy tokens equal Hugging Face transformers' on the same weights, token for token,
however the requests arrive and however the KV cache is shared or reclaimed."""

from __future__ import annotations

import pytest

from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, RequestOutput, SamplingParams
from tests.engine.conftest import MAX_TOKENS
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine, merge_output


def _engine(ck: Checkpoint, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"num_blocks": 256, **kw}), ck)  # type: ignore[arg-type]


def _req(i: int, ids: list[int], tenant: str = "t") -> GenerationRequest:
    return GenerationRequest(
        f"r{i}", ids, SamplingParams(max_tokens=MAX_TOKENS), tenant=tenant, cache_salt=tenant.encode()
    )


def _assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_consistency()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} KV blocks leaked"
    assert not engine.has_unfinished()


def _tokens(outs: dict[str, RequestOutput], n: int) -> list[list[int]]:
    return [outs[f"r{i}"].token_ids for i in range(n)]


def test_reference_is_nontrivial(hf_reference: list[list[int]]) -> None:
    # Guards the guard: the reference must produce real text, not an immediate end token.
    assert all(len(t) >= 5 for t in hf_reference)


def test_one_by_one(smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]]) -> None:
    engine = _engine(smollm)
    for i, ids in enumerate(prompt_ids):
        out = engine.run_to_completion([_req(i, ids)])[f"r{i}"]
        assert out.token_ids == hf_reference[i], f"prompt {i}"
        assert out.completion_tokens == len(out.token_ids)
        _assert_all_free(engine)


def test_all_at_once(smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]]) -> None:
    engine = _engine(smollm)
    outs = engine.run_to_completion([_req(i, ids) for i, ids in enumerate(prompt_ids)])
    assert _tokens(outs, len(prompt_ids)) == hf_reference
    _assert_all_free(engine)


def test_staggered_with_small_chunks(
    smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]]
) -> None:
    # A new request every 3 steps, while others are mid-generation; prompts split into 16-token chunks.
    engine = _engine(smollm, max_num_batched_tokens=16)
    merged: dict[str, RequestOutput] = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, ids = pending.pop(0)
            engine.add_request(_req(i, ids))
        for out in engine.step():
            merge_output(merged, out)
        step += 1
    assert _tokens(merged, len(prompt_ids)) == hf_reference
    _assert_all_free(engine)


def test_prefix_cache_hits(
    smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]]
) -> None:
    engine = _engine(smollm, block_size=8)
    engine.run_to_completion([_req(100, prompt_ids[0])])
    first = engine.run_to_completion([_req(i, ids) for i, ids in enumerate(prompt_ids)])
    # Every chat prompt shares the template's system prompt with the one served before.
    assert all(o.cached_prompt_tokens >= 16 for o in first.values())
    second = engine.run_to_completion([_req(i, ids) for i, ids in enumerate(prompt_ids)])
    for i, ids in enumerate(prompt_ids):
        assert second[f"r{i}"].cached_prompt_tokens == (len(ids) - 1) // 8 * 8, f"prompt {i} missed the cache"
    assert _tokens(first, len(prompt_ids)) == hf_reference
    assert _tokens(second, len(prompt_ids)) == hf_reference
    _assert_all_free(engine)


def test_prefix_cache_is_salted(smollm: Checkpoint, prompt_ids: list[list[int]]) -> None:
    engine = _engine(smollm, block_size=8)
    engine.run_to_completion([_req(0, prompt_ids[0], tenant="alice")])
    other = engine.run_to_completion([_req(1, prompt_ids[0], tenant="bob")])["r1"]
    same = engine.run_to_completion([_req(2, prompt_ids[0], tenant="alice")])["r2"]
    assert other.cached_prompt_tokens == 0
    assert same.cached_prompt_tokens > 0
    _assert_all_free(engine)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_recompute(
    smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]], caching: bool
) -> None:
    # 14 blocks of 8 tokens cannot hold eight ~60-token sequences at once: the scheduler must preempt.
    engine = _engine(smollm, block_size=8, num_blocks=14, enable_prefix_caching=caching)
    outs = engine.run_to_completion([_req(i, ids) for i, ids in enumerate(prompt_ids)])
    assert engine.stats().num_preemptions > 0
    stats = engine.stats()
    assert 0 < stats.recomputed_tokens < stats.computed_tokens  # the preempted work, counted as waste
    assert _tokens(outs, len(prompt_ids)) == hf_reference
    _assert_all_free(engine)
