"""The engine with the Triton path forced (interpreter on CPU) produces exactly the greedy tokens of
the torch reference path: prefill chunks mixed with decodes, staggered arrivals, prefix-cache hits
(cached context plus a new chunk), GQA groups of 2 and 3, KV block size 8."""

from __future__ import annotations

import pytest

from kernels import force_triton
from loadtest.tiny_model import random_checkpoint, tiny_config
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, RequestOutput, SamplingParams
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine, merge_output

FIRST = ["the loom weaves", "a b c d e f g h i j k", "paged attention, one block at a time", "x"]
# Share at least one full 8-token block with a first-round prompt, so the prefix cache serves it.
SECOND = ["the loom weaves a second cloth", "a b c d e f g h i j k l m n o p"]


def _req(rid: str, engine: LLMEngine, text: str) -> GenerationRequest:
    ids = engine.tokenizer.encode(text)
    return GenerationRequest(rid, ids, SamplingParams(max_tokens=10, ignore_eos=True))


def _serve(ckpt: Checkpoint, triton: bool) -> tuple[dict[str, list[int]], int]:
    """Greedy tokens of every request, and the prefix-cache hits, on a fresh engine."""
    engine = LLMEngine(
        EngineConfig(num_blocks=64, block_size=8, max_num_batched_tokens=16, max_model_len=256), ckpt
    )
    merged: dict[str, RequestOutput] = {}
    with force_triton(triton):
        # Staggered: two requests, a few steps, then the other two join mid-generation.
        for i, text in enumerate(FIRST[:2]):
            engine.add_request(_req(f"a{i}", engine, text))
        for _ in range(3):
            for out in engine.step():
                merge_output(merged, out)
        for i, text in enumerate(FIRST[2:], start=2):
            engine.add_request(_req(f"a{i}", engine, text))
        for out in engine.drain().values():
            merge_output(merged, out)
        # Second round: prompts extending first-round ones hit the prefix cache.
        for i, text in enumerate(SECOND):
            engine.add_request(_req(f"b{i}", engine, text))
        for out in engine.drain().values():
            merge_output(merged, out)
    return {rid: out.token_ids for rid, out in merged.items()}, engine.stats().prefix_cache_hits


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2)])
def test_forced_triton_matches_reference_greedy(heads: int, kv_heads: int) -> None:
    ckpt = random_checkpoint(tiny_config(num_heads=heads, num_kv_heads=kv_heads), seed=heads)
    reference, ref_hits = _serve(ckpt, triton=False)
    triton, tri_hits = _serve(ckpt, triton=True)
    assert ref_hits > 0 and tri_hits == ref_hits, "the second round must reuse cached prefix blocks"
    assert set(reference) == {f"a{i}" for i in range(len(FIRST))} | {f"b{i}" for i in range(len(SECOND))}
    assert all(len(t) == 10 for t in reference.values())
    assert triton == reference
