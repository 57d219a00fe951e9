"""A stream's time limit, kept while it waits for output as well as when output arrives.

Checking the clock at each output cannot end a stream whose output never comes (a request queued
behind others for good, a replica that stalls). One timer per stream ends it instead: if the stream
is waiting for its next output when the time is up, that wait is cancelled and becomes
DEADLINE_EXCEEDED; if not, the next wait refuses to start. Nothing is added per output but a flag.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from gateway.errors import ErrorKind, GatewayError

T = TypeVar("T")


class StreamDeadline:
    """``close`` it when the stream ends. The task reading the stream may change between items (a
    front reads the first in its handler and the rest in its response's task): each wait names its own."""

    def __init__(self, seconds: float, message: str) -> None:
        self._task: asyncio.Task[object] | None = None
        self._message = message
        self._waiting = False
        self._cancelled = False  # the task was cancelled by this deadline (not by anyone else)
        self.expired = False
        self._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self._waiting and self._task is not None:
            self._cancelled = True
            self._task.cancel()

    async def next(self, outputs: AsyncIterator[T]) -> T:
        """The stream's next item (StopAsyncIteration at its end); DEADLINE_EXCEEDED past the limit."""
        if self.expired:
            raise GatewayError(ErrorKind.DEADLINE_EXCEEDED, self._message)
        self._task = task = asyncio.current_task()
        self._waiting = True
        try:
            return await anext(outputs)
        except asyncio.CancelledError:
            if self._cancelled and task is not None:
                self._cancelled = False
                if task.uncancel() == 0:  # only this deadline cancelled the wait
                    raise GatewayError(ErrorKind.DEADLINE_EXCEEDED, self._message) from None
            raise
        finally:
            self._waiting = False

    def close(self) -> None:
        self._timer.cancel()
