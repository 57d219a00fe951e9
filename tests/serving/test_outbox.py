"""A replica's outbox for one gateway process: deltas of many requests per stream item, a stream that
ends when idle, one reader at a time, and the requests of a gateway that went away aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from protocol.requests import FinishReason, RequestOutput, TokenLogprob
from serving.outbox import Outbox, Outboxes, RequestFailed


def _out(rid: str, token: int, done: bool = False) -> RequestOutput:
    return RequestOutput(rid, "x", [token], FinishReason.LENGTH if done else None)


async def _next(stream: AsyncIterator[list[RequestOutput]]) -> list[RequestOutput]:
    return await asyncio.wait_for(anext(stream), 2)


async def test_what_waits_is_taken_in_one_item_and_a_request_ends_with_its_final_output() -> None:
    box = Outbox(asyncio.get_running_loop())
    a, b = box.track("a"), box.track("b")
    stream = box.stream(linger_s=5)
    assert await _next(stream) == []  # the handshake
    box.deliver([_out("a", 1), _out("b", 2)])
    box.deliver([_out("a", 3, done=True)])  # a second step before the reader came back
    batch = await _next(stream)
    assert [(o.request_id, o.token_ids) for o in batch] == [("a", [1]), ("b", [2]), ("a", [3])]
    assert a.done() and not b.done() and box.live == ["b"]
    error = RuntimeError("refused")
    box.fail("b", error)  # its error travels on the stream, in its place among the deltas
    assert b.done() and b.result() is None and box.live == []
    assert await _next(stream) == [RequestFailed("b", error)]
    await stream.aclose()


async def test_a_stream_ends_once_nothing_is_owed_or_live_and_not_before() -> None:
    box = Outbox(asyncio.get_running_loop())
    box.track("a")
    stream = box.stream(linger_s=0.05)
    assert await _next(stream) == []
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.2)  # several lingers: a live request keeps the stream
    assert not waiting.done()
    box.deliver([_out("a", 1, done=True)])
    assert [o.token_ids for o in await waiting] == [[1]]
    with pytest.raises(StopAsyncIteration):
        await _next(stream)  # nothing live, nothing owed: it ends after one linger
    assert box.streams_open == 0 and box.unsubscribed_since is not None


async def test_a_newer_stream_supersedes_the_older_one() -> None:
    box = Outbox(asyncio.get_running_loop())
    box.track("a")
    old = box.stream(linger_s=5)
    assert await _next(old) == []
    old_waiting = asyncio.ensure_future(anext(old))
    await asyncio.sleep(0)
    new = box.stream(linger_s=5)
    assert await _next(new) == []
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(old_waiting, 2)  # the old reader stops, so no delta goes to both
    box.deliver([_out("a", 7)])
    assert [o.token_ids for o in await _next(new)] == [[7]]
    await new.aclose()


async def test_requests_of_a_subscriber_gone_too_long_are_aborted_and_its_outbox_forgotten() -> None:
    aborted: list[str] = []
    boxes = Outboxes(aborted.append)
    gone, here = boxes.of("gateway-1"), boxes.of("gateway-2")
    gone.track("g/1")
    here.track("h/1")
    stream = here.stream(linger_s=5)
    assert await _next(stream) == []
    assert gone.unsubscribed_since is not None
    assert boxes.sweep(now=gone.unsubscribed_since + 1, orphan_s=30) == []  # a gap is not a death
    assert boxes.sweep(now=gone.unsubscribed_since + 31, orphan_s=30) == ["g/1"]
    assert aborted == ["g/1"] and len(boxes) == 1  # the subscriber with a stream keeps its requests
    await stream.aclose()


async def test_with_a_stream_interval_a_request_ships_its_first_token_at_once_then_in_merged_groups() -> None:
    box = Outbox(asyncio.get_running_loop(), stream_interval=3)
    a, _ = box.track("a"), box.track("b")
    lp = TokenLogprob(0, -1.0)
    step = [RequestOutput("a", "A0", [10], cached_prompt_tokens=5, logprobs=[lp]), _out("b", 20)]
    box.deliver(step)
    assert [(o.request_id, o.token_ids) for o in box._owed] == [("a", [10]), ("b", [20])]
    box._owed.clear()
    for i in (1, 2):
        box.deliver([RequestOutput("a", f"A{i}", [10 + i], cached_prompt_tokens=5, logprobs=[lp])])
        box.deliver([_out("b", 20 + i)])
    assert box._owed == []  # two more tokens each: short of the interval, held
    box.deliver([RequestOutput("a", "A3", [13], cached_prompt_tokens=5, logprobs=[lp])])
    due = {o.request_id: o for o in box._owed}
    assert due["a"].token_ids == [11, 12, 13] and due["a"].text == "A1A2A3"
    assert due["a"].logprobs == [lp, lp, lp] and due["a"].cached_prompt_tokens == 5
    box._owed.clear()
    box.deliver([RequestOutput("a", "!", [14], FinishReason.STOP)])  # an end ships what is held at once
    assert [(o.token_ids, o.finish_reason) for o in box._owed] == [([14], FinishReason.STOP)]
    assert a.done()
    box._owed.clear()
    died = RuntimeError("engine died")
    box.fail("b", died)  # what b made before failing still goes out, then its error
    assert [o.token_ids for o in box._owed[:1]] == [[21, 22]] and box._owed[1:] == [RequestFailed("b", died)]
    box._owed.clear()
    assert box.idle
    box.track("c")
    box.deliver([_out("c", 1)])
    box.deliver([RequestOutput("c", "xyz", [2, 3, 4])])  # a step that verified 3 proposals: due at once
    assert [o.token_ids for o in box._owed] == [[1], [2, 3, 4]]


async def test_a_request_given_up_leaves_nothing_held() -> None:
    box = Outbox(asyncio.get_running_loop(), stream_interval=4)
    box.track("a")
    box.deliver([_out("a", 1)])
    box.deliver([_out("a", 2)])
    box._owed.clear()
    assert not box.idle  # a held token keeps the stream: it is owed once the interval fills
    box.untrack("a")
    assert box.idle and not box._held and not box._started
