"""Helpers shared by test folders (tests/ is a package; tenancy tests import this through their testlib)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


async def eventually(predicate: Any, *, timeout_s: float = 10.0, interval_s: float = 0.02) -> None:
    """Poll ``predicate`` (sync or async) until it is truthy; fail after a generous ``timeout_s``.

    A liveness guard for things that happen asynchronously (a pub/sub message, a lease lapse), not a
    speed assertion: the timeout is far above the expected delay.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        await asyncio.sleep(interval_s)
