"""One clock for every stream's writes in a gateway process.

A write to a client waits only once the transport's buffers are full, that is when the client has
read nothing for a while; such a stream must end (releasing its lease, slot and buffered output)
instead of lingering. Arming a timer (``asyncio.timeout``) or a task (``asyncio.wait_for``) around each
write would cost every streamed delta a heap push and a cancel, for the rare client that stalls.
Instead a write records when it began and clears it when done (two dict operations: almost every
write completes without suspending), and one watcher per process, alive only while writes happen,
cancels the writers whose write has been pending longer than the limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class StreamStalled(Exception):
    """The client read nothing for the stall limit; its stream is to be ended."""

    def __init__(self, stall_s: float) -> None:
        super().__init__(f"the client read nothing for {stall_s:g} s")
        self.stall_s = stall_s


class StallWatch:
    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        # A stall is seen between stall_s and stall_s + tick_s after its write began.
        self._tick_s = min(1.0, stall_s / 4)
        self._pending: dict[asyncio.Task[Any], float] = {}  # writer -> when its write began
        self._stalled: set[asyncio.Task[Any]] = set()
        self._wrote_since_tick = False
        self._watcher: asyncio.Task[None] | None = None

    async def write(self, writer: asyncio.Task[Any], write: Awaitable[T]) -> T:
        """Await ``write`` in ``writer`` (the current task, which a stream looks up once); raise
        StreamStalled if it is still pending after the stall limit."""
        loop = writer.get_loop()
        self._pending[writer] = loop.time()
        self._wrote_since_tick = True
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch(), name="loom-stall-watch")
        try:
            return await write
        except asyncio.CancelledError:
            if writer not in self._stalled:  # the client left, or the server is stopping: not ours
                raise
            self._stalled.discard(writer)
            writer.uncancel()
            raise StreamStalled(self.stall_s) from None
        finally:
            self._pending.pop(writer, None)
            self._stalled.discard(writer)  # even where the write swallowed the cancel: no task kept

    async def _watch(self) -> None:
        """Runs while writes keep coming (or one is pending); ends after a quiet tick."""
        loop = asyncio.get_running_loop()
        while self._pending or self._wrote_since_tick:
            self._wrote_since_tick = False
            await asyncio.sleep(self._tick_s)
            now = loop.time()
            for task, began in list(self._pending.items()):
                if now - began >= self.stall_s and task not in self._stalled:
                    self._stalled.add(task)
                    task.cancel()
