"""The gateway's side: one stream per replica carries the deltas of every request there, routed to
each request's queue; a stream that fails fails only the requests on its replica."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from protocol.requests import FinishReason, RequestOutput
from serving.delta_streams import DeltaStreams
from serving.pinning import Pinned
from serving.replica_stats import ReplicaStatsRegistry

DEPLOYMENT = "app/engine"


class _Replicas:
    """Stand-in handle: ``deltas.remote(pinned)`` opens a stream from the pinned replica's script."""

    def __init__(self) -> None:
        self.feeds: dict[str, asyncio.Queue[list[RequestOutput] | BaseException]] = {}
        self.opened: list[str] = []
        self.deltas = self

    def options(self, **_: Any) -> _Replicas:
        return self

    def remote(self, pinned: Pinned) -> _Stream:
        self.opened.append(pinned.replica_id)
        return _Stream(self._stream(self.feeds.setdefault(pinned.replica_id, asyncio.Queue())))

    async def _stream(self, feed: asyncio.Queue[list[RequestOutput] | BaseException]) -> Any:
        yield []
        while True:
            item = await feed.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def feed(self, replica: str) -> asyncio.Queue[list[RequestOutput] | BaseException]:
        return self.feeds.setdefault(replica, asyncio.Queue())


class _Stream:
    def __init__(self, gen: AsyncIterator[list[RequestOutput]]) -> None:
        self.gen = gen
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        return self.gen

    def cancel(self) -> None:
        self.cancelled = True


def _out(rid: str, token: int, done: bool = False) -> RequestOutput:
    return RequestOutput(rid, "x", [token], FinishReason.LENGTH if done else None)


async def _get(queue: asyncio.Queue[Any]) -> Any:
    return await asyncio.wait_for(queue.get(), 2)


async def test_one_stream_per_replica_carries_every_request_there() -> None:
    registry, replicas = ReplicaStatsRegistry(), _Replicas()
    streams = DeltaStreams(replicas, DEPLOYMENT, registry)  # type: ignore[arg-type]
    qa, qb, qc = streams.open("a"), streams.open("b"), streams.open("c")
    registry.routed(DEPLOYMENT, "a", "r1")
    registry.routed(DEPLOYMENT, "b", "r1")
    registry.routed(DEPLOYMENT, "c", "r2")
    registry.routed(DEPLOYMENT, "someone-else", "r2")  # another process's request: not ours
    replicas.feed("r1").put_nowait([_out("a", 1), _out("b", 2)])
    replicas.feed("r2").put_nowait([_out("c", 3)])
    assert (await _get(qa)).token_ids == [1]
    assert (await _get(qb)).token_ids == [2]
    assert (await _get(qc)).token_ids == [3]
    assert sorted(replicas.opened) == ["r1", "r2"]  # one stream each, not one per request
    await streams.close()


async def test_a_failed_stream_fails_the_requests_on_its_replica_only() -> None:
    registry, replicas = ReplicaStatsRegistry(), _Replicas()
    streams = DeltaStreams(replicas, DEPLOYMENT, registry)  # type: ignore[arg-type]
    qa, qb = streams.open("a"), streams.open("b")
    registry.routed(DEPLOYMENT, "a", "r1")
    registry.routed(DEPLOYMENT, "b", "r2")
    replicas.feed("r1").put_nowait(ConnectionError("replica r1 died"))
    assert isinstance(await _get(qa), ConnectionError)
    replicas.feed("r2").put_nowait([_out("b", 9, done=True)])
    assert (await _get(qb)).token_ids == [9]
    await streams.close()


async def test_deltas_of_a_closed_request_are_dropped() -> None:
    registry, replicas = ReplicaStatsRegistry(), _Replicas()
    streams = DeltaStreams(replicas, DEPLOYMENT, registry)  # type: ignore[arg-type]
    qa, qb = streams.open("a"), streams.open("b")
    registry.routed(DEPLOYMENT, "a", "r1")
    registry.routed(DEPLOYMENT, "b", "r1")
    await asyncio.sleep(0.01)
    streams.release("a")
    replicas.feed("r1").put_nowait([_out("a", 1), _out("b", 2)])
    assert (await _get(qb)).token_ids == [2]
    assert qa.empty()
    await streams.close()
