"""A gateway's calls into a deployment: a lone request leaves at once, a burst leaves in few calls
(one per routing round trip), each request's outcome is its own, and a call is cancelled only when
every request in it was given up."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from protocol.requests import GenerationRequest, SamplingParams
from serving import dispatch
from serving.dispatch import Dispatcher


class _Response:
    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.cancelled = False

    def __await__(self) -> Any:
        return self.future.__await__()

    def cancel(self) -> None:
        self.cancelled = True
        if not self.future.done():
            self.future.cancel()


class _Handle:
    """Stand-in deployment handle: records each ``generate.remote`` call's request ids."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], _Response]] = []
        self.generate = self

    def remote(self, requests: list[GenerationRequest], subscriber: str) -> _Response:
        assert subscriber == "gw"
        response = _Response()
        self.calls.append(([r.request_id for r in requests], response))
        return response

    def ids(self) -> list[list[str]]:
        return [ids for ids, _ in self.calls]


def _req(rid: str, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2], SamplingParams(max_tokens=2), **kw)


async def _tick() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_lone_request_leaves_at_once_and_a_burst_leaves_per_routing_round_trip() -> None:
    handle = _Handle()
    d = Dispatcher(handle, "gw")  # type: ignore[arg-type]
    d.submit(_req("a"))
    d.submit(_req("b"))  # the same loop tick: the same call
    await _tick()
    assert handle.ids() == [["a", "b"]]
    for rid in "cdef":  # the call is not routed yet: these wait for it
        d.submit(_req(rid))
        await _tick()
    assert handle.ids() == [["a", "b"]]
    d.routed("b")  # not the call's first request: nothing changes
    assert len(handle.calls) == 1
    d.routed("a")
    assert handle.ids() == [["a", "b"], ["c", "d", "e", "f"]] and d.calls == 2
    d.routed("c")
    d.submit(_req("g"))  # nothing waits for its replica: g leaves in its own tick
    await _tick()
    assert handle.ids()[-1] == ["g"]
    await d.close()


async def test_a_call_not_routed_in_time_holds_the_next_no_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "MAX_HOLD_S", 0.02)
    handle = _Handle()
    d = Dispatcher(handle, "gw")  # type: ignore[arg-type]
    d.submit(_req("a"))
    await _tick()
    d.submit(_req("b"))
    await asyncio.sleep(0.1)
    assert handle.ids() == [["a"], ["b"]]
    await d.close()


async def test_each_request_learns_how_its_call_ended() -> None:
    handle = _Handle()
    d = Dispatcher(handle, "gw")  # type: ignore[arg-type]
    a, b = d.submit(_req("a")), d.submit(_req("b"))
    await _tick()
    c = d.submit(_req("c"))
    ((_, first),) = handle.calls
    lost = RuntimeError("replica lost")
    first.future.set_exception(lost)  # refused or lost before routing: the next call leaves
    await _tick()
    assert a.exception() is lost and b.exception() is lost and not c.done()
    assert handle.ids() == [["a", "b"], ["c"]]
    handle.calls[1][1].future.set_result(None)
    await _tick()
    assert c.done() and c.exception() is None
    await d.close()


async def test_a_call_is_cancelled_once_all_its_requests_were_given_up() -> None:
    handle = _Handle()
    d = Dispatcher(handle, "gw")  # type: ignore[arg-type]
    d.submit(_req("a"))
    d.submit(_req("b"))
    await _tick()
    waiting = d.submit(_req("c"))
    d.give_up("c")  # never sent: it leaves the queue, and no call carries it
    assert waiting.cancelled()
    ((_, response),) = handle.calls
    d.give_up("a")
    assert not response.cancelled  # b still runs in that call
    d.give_up("b")
    assert response.cancelled
    d.routed("a")
    await _tick()
    assert handle.ids() == [["a", "b"]]
    await d.close()


async def test_a_retry_goes_alone_even_in_a_burst() -> None:
    handle = _Handle()
    d = Dispatcher(handle, "gw")  # type: ignore[arg-type]
    d.submit(_req("a"))
    await _tick()
    d.submit(_req("b"))
    d.submit(replace(_req("a#retry1"), retry_of="a"))  # sent at once, on its own
    assert handle.ids() == [["a"], ["a#retry1"]]
    d.routed("a#retry1")
    assert handle.ids() == [["a"], ["a#retry1"], ["b"]]
    await d.close()
