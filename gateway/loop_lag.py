"""How late the gateway's event loop runs what it scheduled: the delay every stream's next write
waits behind. A hostile body that holds the loop (a huge decode, a long tokenize) shows here first.

One timer every ``INTERVAL_S``: its lateness is observed into a histogram. The cost is one wake-up per
interval, nothing per request.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

INTERVAL_S = 0.1

LOOP_LAG = Histogram(
    "loom:gateway_event_loop_lag_seconds",
    "How late the gateway's event loop ran a timer due every 0.1 s.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


async def watch_loop_lag() -> None:
    """Run until cancelled, observing each interval's lateness."""
    while True:
        due = time.perf_counter() + INTERVAL_S
        await asyncio.sleep(INTERVAL_S)
        LOOP_LAG.observe(max(0.0, time.perf_counter() - due))
