"""ServeEnginePool's retries, with a stand-in DeploymentHandle: a replica that fails or dies before any
output is not the end of a request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.engine_pool import WorkerLostError
from protocol.requests import EngineDeadError, FinishReason, GenerationRequest, RequestOutput, SamplingParams
from serving.pinning import Pinned, ReplicaGoneError
from serving.pools import ServeEnginePool
from serving.replica_stats import ReplicaStatsRegistry


class _Call:
    """A call's response: awaiting it (a unary call) or iterating it (a stream) runs ``work``;
    ``cancel`` cancels it."""

    def __init__(self, work: Any) -> None:
        self._task = asyncio.ensure_future(work)
        self.cancelled = False

    def __await__(self) -> Any:
        return self._task.__await__()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[Any]:
        result = await self._task
        for item in result:
            yield item

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()


class _Handle:
    """A stand-in deployment of one replica: each ``generate.remote`` plays the next scripted attempt,
    its outputs shipped on the subscriber's ``deltas`` stream as a replica ships them."""

    app_name, deployment_name = "app", "engine"
    replica = "replica-1"

    def __init__(self, attempts: list[list[RequestOutput | BaseException]], registry: ReplicaStatsRegistry):
        self.attempts = attempts
        self.registry = registry
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.batches: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self.refusals = 0  # delta streams refused as pinned to a gone replica before one opens
        self.generate, self.deltas, self.abort = (
            _Method(self._generate),
            _Method(self._deltas),
            _Method(self._abort),
        )

    def options(self, **_: Any) -> _Handle:
        return self

    def _generate(self, requests: list[GenerationRequest], subscriber: str) -> _Call:
        (request,) = requests  # one at a time here: each call plays one attempt
        self.requests.append(request)
        return _Call(self._play(request, self.attempts.pop(0)))

    async def _play(
        self, request: GenerationRequest, script: list[RequestOutput | BaseException]
    ) -> list[Any]:
        self.registry.routed("app/engine", request.request_id, self.replica)
        for item in script:
            await asyncio.sleep(0.01)  # the stream carries what came before before the call ends
            if isinstance(item, BaseException):
                raise item
            self.batches.put_nowait([item])
        return []

    def _deltas(self, pinned: Pinned) -> Any:
        assert pinned.replica_id == self.replica
        if self.refusals:
            self.refusals -= 1
            return _Call(self._refuse())
        return _Stream(self.batches)

    async def _refuse(self) -> list[Any]:
        raise ReplicaGoneError(f"replica {self.replica} is gone (this is another)")

    async def _abort_call(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _abort(self, pinned: Pinned, request_id: str) -> Any:
        return self._abort_call(request_id)


class _Stream:
    def __init__(self, batches: asyncio.Queue[list[RequestOutput]]) -> None:
        self.batches = batches

    def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[list[RequestOutput]]:
        yield []
        while True:
            yield await self.batches.get()

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def _out(
    rid: str, tokens: list[int], reason: FinishReason | None = None, error: str | None = None
) -> RequestOutput:
    return RequestOutput(rid, "x" * len(tokens), tokens, reason, completion_tokens=len(tokens), error=error)


REQ = GenerationRequest("t/r", [1, 2, 3], SamplingParams(max_tokens=2))


def _pool(attempts: list[list[RequestOutput | BaseException]]) -> tuple[ServeEnginePool, _Handle]:
    registry = ReplicaStatsRegistry()
    handle = _Handle(attempts, registry)
    return ServeEnginePool(handle, "shared", registry), handle  # type: ignore[arg-type]


async def _drain(pool: ServeEnginePool) -> list[RequestOutput]:
    return [o async for o in pool.generate(REQ)]


async def test_an_engine_failure_before_output_is_retried_once_elsewhere() -> None:
    pool, handle = _pool(
        [
            [_out("t/r", [], FinishReason.ERROR, "RuntimeError: device lost")],
            [_out("t/r#retry1", [7]), _out("t/r#retry1", [8], FinishReason.LENGTH)],
        ]
    )
    outs = await _drain(pool)
    assert [t for o in outs for t in o.token_ids] == [7, 8] and outs[-1].finish_reason is FinishReason.LENGTH
    retry = handle.requests[1]
    assert retry.retry_of == "t/r" and retry.request_id != "t/r"  # the router steers it off that replica
    assert retry.prompt_token_ids == REQ.prompt_token_ids


async def test_a_second_engine_failure_is_the_answer() -> None:
    failed = [_out("t/r", [], FinishReason.ERROR, "again")]
    pool, handle = _pool([failed, [_out("t/r#retry1", [], FinishReason.ERROR, "again")]])
    outs = await _drain(pool)
    assert outs[-1].finish_reason is FinishReason.ERROR and len(handle.requests) == 2


async def test_a_failure_of_the_requests_own_constraint_is_not_retried() -> None:
    """A grammar that cannot be followed fails the same way on every replica: one attempt, its error
    handed on as the request's own."""
    own = _out("t/r", [], FinishReason.ERROR, "the output constraint failed: too many items")
    own.request_fault = True
    pool, handle = _pool([[own], [_out("t/r#retry1", [5], FinishReason.LENGTH)]])
    outs = await _drain(pool)
    assert (
        len(handle.requests) == 1 and outs[-1].request_fault and outs[-1].finish_reason is FinishReason.ERROR
    )


async def test_a_dead_engine_is_retried_like_a_lost_replica() -> None:
    pool, handle = _pool(
        [[EngineDeadError("the engine loop is not running")], [_out("t/r#retry1", [5], FinishReason.LENGTH)]]
    )
    outs = await _drain(pool)
    assert outs[-1].token_ids == [5] and handle.requests[1].retry_of == "t/r"


async def test_a_loss_after_output_is_for_resume_and_says_nothing_internal() -> None:
    actor_detail = EngineDeadError("actor 9f3c... on node 10.0.0.7 died")
    pool, _ = _pool([[_out("t/r", [5]), actor_detail]])
    with pytest.raises(WorkerLostError) as info:
        await _drain(pool)
    assert "10.0.0.7" not in str(info.value) and "actor" not in str(info.value)


async def test_a_stream_given_up_before_its_end_is_aborted_on_its_replica() -> None:
    pool, handle = _pool([[_out("t/r", [5]), _out("t/r", [6]), _out("t/r", [7], FinishReason.LENGTH)]])
    stream = pool.generate(REQ)
    first = await anext(stream)
    await stream.aclose()
    assert first.token_ids == [5]
    for _ in range(50):
        if handle.aborted:
            break
        await asyncio.sleep(0.01)
    assert handle.aborted == ["t/r"]


async def test_a_call_that_ends_without_its_final_delta_is_a_lost_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import serving.pools

    monkeypatch.setattr(serving.pools, "FINAL_DELTA_GRACE_S", 0.2)
    # The call returns after one delta, but the final one never comes (the stream broke).
    pool, _ = _pool([[_out("t/r", [5])]])
    with pytest.raises(WorkerLostError):
        await _drain(pool)


async def test_a_delta_stream_refused_while_the_router_does_not_list_its_replica_yet_is_tried_again() -> None:
    """A replica can take a request before this process's router lists it (Serve's long poll): the
    pinned stream reaches another replica and is refused. That is no lost replica: the stream is
    opened again, the request is neither failed nor retried elsewhere."""
    pool, handle = _pool([[_out("t/r", [7]), _out("t/r", [8], FinishReason.LENGTH)]])
    handle.refusals = 3
    outs = await _drain(pool)
    assert [t for o in outs for t in o.token_ids] == [7, 8] and outs[-1].finish_reason is FinishReason.LENGTH
    assert handle.refusals == 0 and [r.request_id for r in handle.requests] == ["t/r"]
