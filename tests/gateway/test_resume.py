"""resumable_stream with a stand-in pool whose replica dies on cue."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.pools import PoolModel, WorkerLostError
from gateway.resume import resumable_stream
from loadtest.tiny_model import byte_tokenizer
from worker.api import FinishReason, GenerationRequest, RequestOutput, SamplingParams


class DyingPool:
    """Streams the bytes of ``text`` one token per delta, holding back the last ``hold`` characters'
    text (as a detokenizer waiting on a stop string would), and dies after ``die_after`` tokens."""

    name = "shared"

    def __init__(self, text: str, die_after: list[int], hold: int = 0) -> None:
        self.tok = byte_tokenizer()
        self.tokens = self.tok.encode(text)
        self.die_after = die_after
        self.hold = hold
        self.requests: list[GenerationRequest] = []

    async def describe(self) -> PoolModel:
        return PoolModel("fake", 4096, 257)

    def replica_stats(self) -> dict:
        return {}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        start = len(request.prompt_token_ids) - len(self.requests[0].prompt_token_ids)
        budget = request.sampling.max_tokens
        limit = self.die_after.pop(0) if self.die_after else None
        emitted_text = 0
        for i, tok in enumerate(self.tokens[start : start + budget]):
            if limit is not None and i == limit:
                raise WorkerLostError("replica died")
            done = i + 1 == min(budget, len(self.tokens) - start)
            upto = i + 1 if done else max(0, i + 1 - self.hold)
            text = self.tok.decode(self.tokens[start + emitted_text : start + upto])
            emitted_text = upto
            yield RequestOutput(
                request.request_id,
                text,
                [tok],
                FinishReason.LENGTH if done else None,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=i + 1,
                cached_prompt_tokens=3,
            )


def _request(max_tokens: int, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        "t/r", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0)
    )


async def _drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in stream]


async def test_resumes_with_the_delivered_tokens_and_cumulative_counts() -> None:
    pool = DyingPool("abcdefghij", die_after=[4, 3], hold=2)
    outs = await _drain(resumable_stream(pool, _request(10, seed=5), byte_tokenizer()))
    assert "".join(o.text for o in outs) == "abcdefghij"  # held-back text recovered at each cut
    assert [t for o in outs for t in o.token_ids] == pool.tokens
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert (outs[-1].prompt_tokens, outs[-1].completion_tokens, outs[-1].cached_prompt_tokens) == (4, 10, 3)
    second, third = pool.requests[1], pool.requests[2]
    assert second.prompt_token_ids == [1, 2, 3, 4, *pool.tokens[:4]] and second.sampling.max_tokens == 6
    assert third.prompt_token_ids == [1, 2, 3, 4, *pool.tokens[:7]] and third.sampling.max_tokens == 3
    assert len({r.request_id for r in pool.requests}) == 3
    assert second.sampling.seed not in (None, 5) and second.sampling.seed != third.sampling.seed


async def test_gives_up_after_the_last_resume() -> None:
    pool = DyingPool("abcdefghij", die_after=[2, 2, 2])
    with pytest.raises(WorkerLostError):
        await _drain(resumable_stream(pool, _request(10), byte_tokenizer(), max_resumes=2))
    assert len(pool.requests) == 3


async def test_a_loss_before_any_token_is_not_resumed_here() -> None:
    pool = DyingPool("abc", die_after=[0])
    with pytest.raises(WorkerLostError):
        await _drain(resumable_stream(pool, _request(3), byte_tokenizer()))
    assert len(pool.requests) == 1  # the pool itself retries losses before output
