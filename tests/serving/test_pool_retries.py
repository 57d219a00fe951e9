"""ServeEnginePool's retries, with a stand-in DeploymentHandle: a replica that fails or dies before any
output is not the end of a request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.engine_pool import WorkerLostError
from protocol.requests import EngineDeadError, FinishReason, GenerationRequest, RequestOutput, SamplingParams
from serving.pools import ServeEnginePool
from serving.replica_stats import ReplicaStatsRegistry


class _Response:
    def __init__(self, outputs: list[RequestOutput | BaseException]) -> None:
        self._outputs = outputs
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[RequestOutput]:
        for item in self._outputs:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """Each call of ``generate.remote`` plays the next scripted attempt."""

    app_name, deployment_name = "app", "engine"

    def __init__(self, attempts: list[list[RequestOutput | BaseException]]) -> None:
        self.attempts = attempts
        self.requests: list[GenerationRequest] = []
        self.generate = self

    def options(self, **_: Any) -> _Handle:
        return self

    def remote(self, request: GenerationRequest) -> _Response:
        self.requests.append(request)
        return _Response(self.attempts.pop(0))


def _out(
    rid: str, tokens: list[int], reason: FinishReason | None = None, error: str | None = None
) -> RequestOutput:
    return RequestOutput(rid, "x" * len(tokens), tokens, reason, completion_tokens=len(tokens), error=error)


REQ = GenerationRequest("t/r", [1, 2, 3], SamplingParams(max_tokens=2))


async def _drain(pool: ServeEnginePool) -> list[RequestOutput]:
    return [o async for o in pool.generate(REQ)]


async def test_an_engine_failure_before_output_is_retried_once_elsewhere() -> None:
    handle = _Handle(
        [
            [_out("t/r", [], FinishReason.ERROR, "RuntimeError: device lost")],
            [_out("t/r#retry1", [7]), _out("t/r#retry1", [8], FinishReason.LENGTH)],
        ]
    )
    outs = await _drain(ServeEnginePool(handle, "shared", ReplicaStatsRegistry()))
    assert [t for o in outs for t in o.token_ids] == [7, 8] and outs[-1].finish_reason is FinishReason.LENGTH
    retry = handle.requests[1]
    assert retry.retry_of == "t/r" and retry.request_id != "t/r"  # the router steers it off that replica
    assert retry.prompt_token_ids == REQ.prompt_token_ids


async def test_a_second_engine_failure_is_the_answer() -> None:
    failed = [_out("t/r", [], FinishReason.ERROR, "again")]
    handle = _Handle([failed, [_out("t/r#retry1", [], FinishReason.ERROR, "again")]])
    outs = await _drain(ServeEnginePool(handle, "shared", ReplicaStatsRegistry()))
    assert outs[-1].finish_reason is FinishReason.ERROR and len(handle.requests) == 2


async def test_a_dead_engine_is_retried_like_a_lost_replica() -> None:
    handle = _Handle(
        [[EngineDeadError("the engine loop is not running")], [_out("t/r#retry1", [5], FinishReason.LENGTH)]]
    )
    outs = await _drain(ServeEnginePool(handle, "shared", ReplicaStatsRegistry()))
    assert outs[-1].token_ids == [5] and handle.requests[1].retry_of == "t/r"


async def test_a_loss_after_output_is_for_resume_and_says_nothing_internal() -> None:
    actor_detail = EngineDeadError("actor 9f3c... on node 10.0.0.7 died")
    handle = _Handle([[_out("t/r", [5]), actor_detail]])
    with pytest.raises(WorkerLostError) as info:
        await _drain(ServeEnginePool(handle, "shared", ReplicaStatsRegistry()))
    assert "10.0.0.7" not in str(info.value) and "actor" not in str(info.value)
