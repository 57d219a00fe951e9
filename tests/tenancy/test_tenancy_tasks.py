"""Background tasks stop for certain: a lost cancel is repeated, and a task that never yields to one
is reported instead of hanging the shutdown."""

from __future__ import annotations

import asyncio

from tenancy.tasks import cancel_and_wait


async def test_a_task_that_lost_its_first_cancel_is_cancelled_again() -> None:
    async def loses_one_cancel() -> None:
        lost = False
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True  # as an asyncio.timeout racing the cancel can do on Python 3.11

    task = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0.02)
    assert await cancel_and_wait([task], timeout_s=0.2) == []
    assert task.cancelled()


async def test_a_task_that_ignores_every_cancel_is_returned_not_awaited_forever() -> None:
    stop = asyncio.Event()

    async def ignores_cancels() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(ignores_cancels())
    await asyncio.sleep(0.02)  # running (a task cancelled before it starts never runs at all)
    assert await cancel_and_wait([task], timeout_s=0.05, rounds=2) == [task]
    stop.set()
    await task


async def test_errors_of_ended_tasks_are_retrieved() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task]) == []
    assert task._log_traceback is False  # retrieved: no "exception was never retrieved" at exit
