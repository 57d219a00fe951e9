"""The stall watch: a write pending past the limit ends its stream; nothing else does, and an ordinary
write arms no timer and starts no task."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.stall_watch import StallWatch, StreamStalled


async def _done() -> None:
    return None


def _me() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


async def test_a_write_pending_past_the_limit_raises_stream_stalled_and_leaves_its_writer_usable() -> None:
    watch = StallWatch(0.2)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    started = time.monotonic()
    with pytest.raises(StreamStalled, match=r"read nothing for 0\.2 s"):
        await watch.write(_me(), never)
    waited = time.monotonic() - started
    assert 0.2 <= waited < 1.0
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the watch's cancel was taken back
    await asyncio.sleep(0.01)  # so the writer goes on (to abort its call, close its generator)
    assert await watch.write(_me(), asyncio.sleep(0, "written")) == "written"  # and may write again


async def test_a_slow_write_within_the_limit_completes() -> None:
    watch = StallWatch(0.4)
    assert await watch.write(_me(), asyncio.sleep(0.15, "late but in time")) == "late but in time"


async def test_a_cancel_from_elsewhere_is_not_taken_for_a_stall() -> None:
    """The client leaving (the server cancels the handler) must stay a cancellation."""
    watch = StallWatch(5.0)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def write_forever() -> None:
        await watch.write(_me(), never)

    writer = asyncio.ensure_future(write_forever())
    await asyncio.sleep(0.01)
    writer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writer


async def test_only_the_stalled_writer_is_ended() -> None:
    watch = StallWatch(0.2)
    loop = asyncio.get_running_loop()
    stuck: asyncio.Future[None] = loop.create_future()

    async def reader_keeps_up() -> int:
        written = 0
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            await watch.write(_me(), asyncio.sleep(0.01))
            written += 1
        return written

    async def reader_stalls() -> None:
        await watch.write(_me(), stuck)

    results = await asyncio.gather(reader_stalls(), reader_keeps_up(), return_exceptions=True)
    assert isinstance(results[0], StreamStalled)
    assert isinstance(results[1], int) and results[1] > 10


async def test_ordinary_writes_arm_no_timer_and_start_no_task_each(monkeypatch: Any) -> None:
    """Thousands of writes that complete at once cost the loop at most the watcher's own wake-ups."""
    loop = asyncio.get_running_loop()
    counts = {"timers": 0, "tasks": 0}
    call_at, create_task = loop.call_at, loop.create_task

    def counting_call_at(*args: Any, **kwargs: Any) -> Any:
        counts["timers"] += 1
        return call_at(*args, **kwargs)

    def counting_create_task(*args: Any, **kwargs: Any) -> Any:
        counts["tasks"] += 1
        return create_task(*args, **kwargs)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    monkeypatch.setattr(loop, "create_task", counting_create_task)
    watch, me = StallWatch(10.0), _me()
    for _ in range(5000):
        await watch.write(me, _done())
    assert counts["tasks"] <= 1 and counts["timers"] <= 1, counts
