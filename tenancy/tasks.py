"""Stopping background tasks for certain: a cancel can be lost, so it is repeated, within a bound.

On Python 3.11 a cancellation that races an ``asyncio.timeout`` expiring inside the task can be
swallowed (the timeout takes it for its own), and a task cancelled inside a socket read may stay
there until the read fails. A loop task that lost its cancel runs on, and an unbounded ``await`` of
it hangs the whole shutdown (seen in the tests: a lease sweep every 50 ms, a stop that never ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float = 1.0, rounds: int = 3
) -> list[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait for them, cancelling again up to ``rounds`` times; returns the ones
    still running after that (the caller logs or abandons them). Errors of tasks that ended are
    retrieved, so none is reported as never retrieved at exit."""
    tasks = list(tasks)
    pending = [t for t in tasks if not t.done()]
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, still = await asyncio.wait(pending, timeout=timeout_s)
        pending = list(still)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    return pending
