"""Engine-side figures during a load test, scraped from the gateway's Prometheus endpoint.

The client sees latencies; only the engines know why. Every ``interval_s`` the sampler reads the
gateway's ``/metrics`` and keeps, per replica (``pool/replica``):

* the gauges the engine publishes under vLLM's names plus Loom's busy fraction (requests running and
  waiting, KV cache usage, the share of the last 10 s spent in forward steps), summarized per stage
  (mean / max) and joined into the report by time, so a latency spike can be read against the queue
  and the cache at that moment;
* the engine's counters (``loom:engine_step_seconds_total``, ``..._step_seq_seconds_total``,
  ``..._computed_tokens_total``, ``..._recomputed_tokens_total``,
  ``..._step_bytes_total``, ``..._steps_total``) and the capacity gauges (``loom:batch_capacity``,
  ``loom:kv_cache_blocks_used`` / ``_total``), from which :func:`utilization` computes the figures of
  docs/utilization.md over any window: step-busy fraction, slot occupancy, useful-token fraction, KV
  blocks in use and bandwidth (GB/s moved; MBU against a measured copy bandwidth when one is given).
  Counters, not last-step gauges, because a 1 s scrape samples a gauge at random while a counter's
  increase covers every step in between.

The counter math is plain functions over (time, values) samples (:func:`counter_increase`,
:func:`replica_window`, :func:`utilization_figures`), so it is tested on hand-computed samples. A
counter that goes down means its replica restarted (a new process counts from zero): the increase
over that interval is the new value. Windows are bounded by scrapes, so a figure covers the time
between the first and the last scrape inside the window; a replica's counters are as of its latest
step (a served replica's, as of its latest published stats, at most a second old), so over a short
window a fraction can read a step's worth (or that second's worth) high: fractions are capped at 1 and
the raw seconds are kept beside them.

A failed scrape is counted and skipped, never fatal: a load test must not die because the metrics
endpoint hiccuped (or was not started: ``metrics_url: null``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.driver import require_loopback_url

RUNNING = "loom:num_requests_running"
WAITING = "loom:num_requests_waiting"
KV_USAGE = "loom:kv_cache_usage_perc"
BUSY = "loom:engine_busy_fraction"
GAUGES = (RUNNING, WAITING, KV_USAGE, BUSY)  # summarized (mean / max) and plotted as they are

# Counters (sample names as exposed, ``_total`` included) and the gauges utilization divides by.
STEP_SECONDS = "loom:engine_step_seconds_total"
STEP_SEQ_SECONDS = "loom:engine_step_seq_seconds_total"
COMPUTED_TOKENS = "loom:engine_computed_tokens_total"
RECOMPUTED_TOKENS = "loom:engine_recomputed_tokens_total"
STEP_BYTES = "loom:engine_step_bytes_total"
STEPS = "loom:engine_steps_total"
COUNTERS = (
    STEP_SECONDS,
    STEP_SEQ_SECONDS,
    COMPUTED_TOKENS,
    RECOMPUTED_TOKENS,
    STEP_BYTES,
    STEPS,
)
CAPACITY = "loom:batch_capacity"
KV_BLOCKS_USED = "loom:kv_cache_blocks_used"
KV_BLOCKS_TOTAL = "loom:kv_cache_blocks_total"
CAPACITY_GAUGES = (CAPACITY, KV_BLOCKS_USED, KV_BLOCKS_TOTAL)
SCRAPED = frozenset(GAUGES + COUNTERS + CAPACITY_GAUGES)

Sample = tuple[float, dict[str, dict[str, float]]]  # (seconds since the run's start, {replica: {name: v}})


def parse_engine_metrics(text: str) -> dict[str, dict[str, float]]:
    """{"pool/replica": {series: value}} from a Prometheus text exposition, for the series in
    ``SCRAPED`` (counters by their exposed ``_total`` name); waiting summed over classes."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in SCRAPED:
                continue
            labels = sample.labels
            replica = f"{labels.get('pool', '?')}/{labels.get('replica', '?')}"
            values = out[replica]
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return dict(out)


@dataclass
class MetricsSampler:
    url: str
    interval_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)
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
    samples: list[Sample], start_s: float = 0.0, end_s: float = math.inf
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per replica and gauge (of ``GAUGES``): mean and max over the samples taken in [start_s, end_s]."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t, values in samples:
        if start_s <= t <= end_s:
            for replica, gauges in values.items():
                for name, v in gauges.items():
                    if name in GAUGES:
                        acc[replica][name].append(v)
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for replica, gauges in sorted(acc.items()):
        out[replica] = {
            name.removeprefix("loom:"): {"mean": sum(v) / len(v), "max": max(v), "n": float(len(v))}
            for name, v in gauges.items()
        }
    return out


def series(samples: list[Sample]) -> dict[str, Any]:
    """Time series per replica and gauge (of ``GAUGES``), for plots: {replica: {gauge: ([t...], [v...])}}."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = defaultdict(dict)
    for t, values in samples:
        for replica, gauges in values.items():
            for name, v in gauges.items():
                if name not in GAUGES:
                    continue
                ts, vs = out[replica].setdefault(name.removeprefix("loom:"), ([], []))
                ts.append(t)
                vs.append(v)
    return dict(out)


# ---- utilization from the counters (docs/utilization.md) ------------------------------------------


def restarted(points: Sequence[Mapping[str, float]], names: Iterable[str] = COUNTERS) -> list[bool]:
    """For each interval between consecutive points of one replica: did it restart in between? Any of
    its counters going down says so (a counter only grows while its process lives)."""
    names = tuple(names)
    return [any(n in a and n in b and b[n] < a[n] for n in names) for a, b in itertools.pairwise(points)]


def counter_increase(values: Sequence[float], restarts: Sequence[bool] | None = None) -> float:
    """How much a counter grew over consecutive samples. Across a restart (``restarts[i]`` for the
    interval before ``values[i + 1]``, or the value going down) the counter began again at zero, so the
    increase over that interval is its new value: what the new process counted since it started."""
    total = 0.0
    for i in range(1, len(values)):
        prev, cur = values[i - 1], values[i]
        reset = cur < prev or (restarts is not None and restarts[i - 1])
        total += cur if reset else cur - prev
    return total


@dataclass(frozen=True)
class ReplicaWindow:
    """One replica's counter increases over a window, and the gauges utilization divides by."""

    wall_s: float  # between its first and last scrape in the window
    scrapes: int
    restarts: int
    step_seconds: float
    step_seq_seconds: float
    steps: float
    computed_tokens: float
    recomputed_tokens: float
    step_bytes: float
    capacity: float  # batch capacity (max_num_seqs), its latest value in the window
    slot_seconds: float  # step seconds x capacity (the denominator of slot occupancy)
    kv_used_mean: float | None  # blocks in use, mean over the scrapes
    kv_used_fraction_max: float | None
    kv_total: float | None

    def to_dict(self) -> dict[str, float | int | None]:
        return dict(self.__dict__)


def replica_window(points: Sequence[tuple[float, Mapping[str, float]]]) -> ReplicaWindow | None:
    """The increases of one replica's counters over its points (time, values) in time order; None
    with fewer than two points carrying the step-seconds counter (nothing can be said)."""
    pts = [(t, v) for t, v in points if STEP_SECONDS in v]
    if len(pts) < 2:
        return None
    values = [v for _, v in pts]
    resets = restarted(values)

    def inc(name: str) -> float:
        if not all(name in v for v in values):
            return 0.0
        return counter_increase([v[name] for v in values], resets)

    step_s = inc(STEP_SECONDS)
    capacity = float(values[-1].get(CAPACITY, 0.0))
    kv = [
        (v[KV_BLOCKS_USED], v[KV_BLOCKS_TOTAL])
        for v in values
        if KV_BLOCKS_USED in v and v.get(KV_BLOCKS_TOTAL, 0) > 0
    ]
    return ReplicaWindow(
        wall_s=pts[-1][0] - pts[0][0],
        scrapes=len(pts),
        restarts=sum(resets),
        step_seconds=step_s,
        step_seq_seconds=inc(STEP_SEQ_SECONDS),
        steps=inc(STEPS),
        computed_tokens=inc(COMPUTED_TOKENS),
        recomputed_tokens=inc(RECOMPUTED_TOKENS),
        step_bytes=inc(STEP_BYTES),
        capacity=capacity,
        slot_seconds=step_s * capacity,
        kv_used_mean=sum(u for u, _ in kv) / len(kv) if kv else None,
        kv_used_fraction_max=max(u / t for u, t in kv) if kv else None,
        kv_total=kv[-1][1] if kv else None,
    )


def _ratio(num: float, den: float, cap: float | None = None) -> float | None:
    if den <= 0:
        return None
    r = num / den
    return min(r, cap) if cap is not None else r


def utilization_figures(
    windows: Sequence[ReplicaWindow], copy_bandwidth_gbs: float | None = None
) -> dict[str, float | int | None]:
    """The figures of docs/utilization.md over one or several replicas' windows (several: replica
    seconds are summed, so each figure is the mean over replicas weighted as the definition says):

    * ``busy_fraction``: step seconds / wall seconds (capped at 1; ``busy_fraction_raw`` is not);
    * ``slot_occupancy``: live-sequence step seconds / (step seconds x batch capacity);
    * ``useful_token_fraction``: 1 - recomputed tokens / computed tokens (static batching's padding,
      a benchmark's scheduler subclass, is not among the engine's counters: bench engine and the
      simulator count it);
    * ``kv_blocks_in_use``: blocks in use / blocks, mean over the scrapes (and the max of one replica);
    * ``gb_per_s_wall`` (bytes the steps moved per wall second, all replicas together) and
      ``gb_per_s_busy`` (per second of step time, per replica: the achieved bandwidth while stepping);
    * ``mbu``: ``gb_per_s_busy`` / the copy bandwidth (the definition: bytes / step time / copy
      bandwidth, time-weighted), ``mbu_wall``: the same over wall time; None without a bandwidth.
    """
    step_s = sum(w.step_seconds for w in windows)
    wall = sum(w.wall_s for w in windows)
    computed = sum(w.computed_tokens for w in windows)
    waste = sum(w.recomputed_tokens for w in windows)
    step_bytes = sum(w.step_bytes for w in windows)
    steps = sum(w.steps for w in windows)
    kv = [w for w in windows if w.kv_used_mean is not None and w.kv_total]
    kv_total = sum(w.kv_total or 0.0 for w in kv)
    gbs_wall = sum(w.step_bytes / w.wall_s for w in windows if w.wall_s > 0) / 1e9
    gbs_busy = _ratio(step_bytes / 1e9, step_s)
    bw = copy_bandwidth_gbs if copy_bandwidth_gbs and copy_bandwidth_gbs > 0 else None
    useful = _ratio(computed - waste, computed)
    return {
        "replicas": len(windows),
        "wall_s": max((w.wall_s for w in windows), default=0.0),
        "restarts": sum(w.restarts for w in windows),
        "busy_fraction": _ratio(step_s, wall, cap=1.0),
        "busy_fraction_raw": _ratio(step_s, wall),
        "slot_occupancy": _ratio(
            sum(w.step_seq_seconds for w in windows), sum(w.slot_seconds for w in windows), 1.0
        ),
        "useful_token_fraction": None if useful is None else max(0.0, useful),
        "kv_blocks_in_use": _ratio(sum(w.kv_used_mean or 0.0 for w in kv), kv_total),
        "kv_blocks_in_use_max": max((w.kv_used_fraction_max or 0.0 for w in kv), default=None),
        "steps_per_s": sum(w.steps / w.wall_s for w in windows if w.wall_s > 0),
        "mean_step_s": _ratio(step_s, steps),
        "computed_tokens_per_s": sum(w.computed_tokens / w.wall_s for w in windows if w.wall_s > 0),
        "gb_per_s_wall": gbs_wall,
        "gb_per_s_busy": gbs_busy,
        "copy_bandwidth_gbs": bw,
        "mbu": _ratio(gbs_busy, bw) if bw is not None and gbs_busy is not None else None,
        "mbu_wall": _ratio(step_bytes / 1e9, wall * bw) if bw is not None else None,
    }


def utilization(
    samples: Sequence[Sample],
    start_s: float = 0.0,
    end_s: float = math.inf,
    copy_bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    """Per replica and over all of them, the utilization figures of the scrapes in [start_s, end_s]:
    {"replicas": {name: {counter increases..., figures...}}, "all": figures | None, "skipped": [...]}
    (``all`` only with two replicas or more; ``skipped``: replicas with fewer than two scrapes there)."""
    points: dict[str, list[tuple[float, Mapping[str, float]]]] = defaultdict(list)
    for t, values in samples:
        if start_s <= t <= end_s:
            for replica, v in values.items():
                points[replica].append((t, v))
    windows: dict[str, ReplicaWindow] = {}
    skipped = []
    for replica, pts in sorted(points.items()):
        w = replica_window(sorted(pts, key=lambda p: p[0]))
        if w is None:
            skipped.append(replica)
        else:
            windows[replica] = w
    return {
        "copy_bandwidth_gbs": copy_bandwidth_gbs,
        "replicas": {
            r: {**w.to_dict(), **utilization_figures([w], copy_bandwidth_gbs)} for r, w in windows.items()
        },
        "all": utilization_figures(list(windows.values()), copy_bandwidth_gbs) if len(windows) > 1 else None,
        "skipped": skipped,
    }


def utilization_series(samples: Sequence[Sample]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Per replica, step-busy fraction and slot occupancy between consecutive scrapes (at the middle
    of each interval), for plots: {replica: {"step_busy": ([t...], [v...]), "slot_occupancy": ...}}."""
    points: dict[str, list[tuple[float, Mapping[str, float]]]] = defaultdict(list)
    for t, values in samples:
        for replica, v in values.items():
            if STEP_SECONDS in v:
                points[replica].append((t, v))
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for replica, pts in sorted(points.items()):
        busy: tuple[list[float], list[float]] = ([], [])
        occ: tuple[list[float], list[float]] = ([], [])
        for a, b in itertools.pairwise(pts):
            w = replica_window([a, b])
            if w is None or w.wall_s <= 0:
                continue
            f = utilization_figures([w])
            mid = (a[0] + b[0]) / 2
            if f["busy_fraction"] is not None:
                busy[0].append(mid)
                busy[1].append(float(f["busy_fraction"]))
            if f["slot_occupancy"] is not None:
                occ[0].append(mid)
                occ[1].append(float(f["slot_occupancy"]))
        out[replica] = {"step_busy": busy, "slot_occupancy": occ}
    return out
