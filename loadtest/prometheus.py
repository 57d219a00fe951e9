"""Engine-side figures during a load test, scraped from the gateway's Prometheus endpoint.

The client sees latencies; only the engines know why. Every ``interval_s`` the sampler reads the
gateway's ``/metrics`` and keeps, per replica (``pool/replica``), the four gauges the engine
publishes under vLLM's names plus Loom's busy fraction: requests running and waiting, KV cache
usage and the share of the last 10 s spent in forward steps. They are joined into the report by
time, so a latency spike can be read against the queue and the cache at that moment.

A failed scrape is counted and skipped, never fatal: a load test must not die because the metrics
endpoint hiccuped (or was not started: ``metrics_url: null``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.driver import require_loopback_url

RUNNING = "loom:num_requests_running"
WAITING = "loom:num_requests_waiting"
KV_USAGE = "loom:kv_cache_usage_perc"
BUSY = "loom:engine_busy_fraction"
GAUGES = (RUNNING, WAITING, KV_USAGE, BUSY)


def parse_engine_metrics(text: str) -> dict[str, dict[str, float]]:
    """{"pool/replica": {gauge: value}} from a Prometheus text exposition; waiting summed over classes."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        if family.name not in GAUGES:
            continue
        for sample in family.samples:
            labels = sample.labels
            replica = f"{labels.get('pool', '?')}/{labels.get('replica', '?')}"
            values = out[replica]
            values[family.name] = values.get(family.name, 0.0) + float(sample.value)
    return dict(out)


@dataclass
class MetricsSampler:
    url: str
    interval_s: float = 1.0
    samples: list[tuple[float, dict[str, dict[str, float]]]] = field(default_factory=list)
    errors: int = 0
    last_error: str | None = None
    _task: asyncio.Task[None] | None = None
    _t0: float = 0.0

    def __post_init__(self) -> None:
        require_loopback_url(self.url)

    def scrape(self) -> dict[str, dict[str, float]]:
        with urllib.request.urlopen(self.url, timeout=2.0) as resp:
            return parse_engine_metrics(resp.read().decode())

    async def _loop(self) -> None:
        while True:
            try:
                values = await asyncio.to_thread(self.scrape)
                self.samples.append((time.monotonic() - self._t0, values))
            except Exception as exc:  # any failure: count it and go on
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(self.interval_s)

    def start(self, t0: float) -> None:
        """Sample from now on; times are seconds since ``t0`` (time.monotonic of the run's start)."""
        self._t0 = t0
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="metrics-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def latest(self) -> dict[str, dict[str, float]]:
        return self.samples[-1][1] if self.samples else {}


def summarize_samples(
    samples: list[tuple[float, dict[str, dict[str, float]]]], start_s: float = 0.0, end_s: float = math.inf
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per replica and gauge: mean and max over the samples taken in [start_s, end_s]."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t, values in samples:
        if start_s <= t <= end_s:
            for replica, gauges in values.items():
                for name, v in gauges.items():
                    acc[replica][name].append(v)
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for replica, gauges in sorted(acc.items()):
        out[replica] = {
            name.removeprefix("loom:"): {"mean": sum(v) / len(v), "max": max(v), "n": float(len(v))}
            for name, v in gauges.items()
        }
    return out


def series(samples: list[tuple[float, dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Time series per replica and gauge, for plots: {replica: {gauge: ([t...], [v...])}}."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = defaultdict(dict)
    for t, values in samples:
        for replica, gauges in values.items():
            for name, v in gauges.items():
                ts, vs = out[replica].setdefault(name.removeprefix("loom:"), ([], []))
                ts.append(t)
                vs.append(v)
    return dict(out)
