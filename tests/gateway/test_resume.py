"""resumable_stream with a stand-in pool whose replica dies on cue (the engine's side of a resume, text
continuing exactly across the cut, is tested in tests/engine/test_resume_text.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.engine_pool import WorkerLostError
from gateway.resume import resumable_stream
from loadtest.tiny_model import byte_tokenizer
from protocol.model_info import ModelInfo
from protocol.requests import FinishReason, GenerationRequest, RequestOutput, SamplingParams


class DyingPool:
    """Streams the bytes of ``text`` one token per delta and dies after ``die_after`` tokens (or, with
    ``die_after_final``, just after its last delta)."""

    name = "shared"

    def __init__(self, text: str, die_after: list[int], die_after_final: bool = False) -> None:
        self.tok = byte_tokenizer()
        self.tokens = self.tok.encode(text)
        self.die_after = die_after
        self.die_after_final = die_after_final
        self.requests: list[GenerationRequest] = []

    async def describe(self) -> ModelInfo:
        return ModelInfo("fake", 4096, 257)

    def replica_stats(self) -> dict:
        return {}

    async def close(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        start = request.num_resumed_tokens
        budget = request.sampling.max_tokens
        limit = self.die_after.pop(0) if self.die_after else None
        for i, tok in enumerate(self.tokens[start : start + budget]):
            if limit is not None and i == limit:
                raise WorkerLostError("replica died")
            done = i + 1 == min(budget, len(self.tokens) - start)
            yield RequestOutput(
                request.request_id,
                self.tok.decode([tok]),
                [tok],
                FinishReason.LENGTH if done else None,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=i + 1,
                cached_prompt_tokens=3,
            )
        if self.die_after_final:
            raise WorkerLostError("replica died as the stream closed")


def _request(max_tokens: int, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        "t/r", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0)
    )


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


async def test_resumes_with_the_delivered_tokens_and_cumulative_counts() -> None:
    pool = DyingPool("abcdefghij", die_after=[4, 3])
    outs = await _drain(resumable_stream(pool, _request(10, seed=5)))
    assert [t for o in outs for t in o.token_ids] == pool.tokens
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens, outs[-1].cached_prompt_tokens) == (4, 10, 3)
    second, third = pool.requests[1], pool.requests[2]
    assert second.prompt_token_ids == [1, 2, 3, 4, *pool.tokens[:4]] and second.sampling.max_tokens == 6
    assert third.prompt_token_ids == [1, 2, 3, 4, *pool.tokens[:7]] and third.sampling.max_tokens == 3
    # The engine learns which prompt tokens are delivered output, to continue their text exactly.
    assert (second.num_resumed_tokens, third.num_resumed_tokens) == (4, 7)
    assert len({r.request_id for r in pool.requests}) == 3
    assert second.sampling.seed not in (None, 5) and second.sampling.seed != third.sampling.seed


async def test_a_replica_lost_after_the_final_delta_is_not_resumed() -> None:
    pool = DyingPool("abc", die_after=[], die_after_final=True)
    outs = await _drain(resumable_stream(pool, _request(3)))
    assert "".join(o.text for o in outs) == "abc" and outs[-1].finish_reason is FinishReason.LENGTH
    assert len(pool.requests) == 1


async def test_gives_up_after_the_last_resume() -> None:
    pool = DyingPool("abcdefghij", die_after=[2, 2, 2])
    with pytest.raises(WorkerLostError):
        await _drain(resumable_stream(pool, _request(10), max_resumes=2))
    assert len(pool.requests) == 3


async def test_a_loss_before_any_token_is_not_resumed_here() -> None:
    pool = DyingPool("abc", die_after=[0])
    with pytest.raises(WorkerLostError):
        await _drain(resumable_stream(pool, _request(3)))
    assert len(pool.requests) == 1  # the pool itself retries losses before output
