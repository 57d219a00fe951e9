"""Seeded arrivals, lengths and priorities: the plan of every request a run will send, made up front.

The plan is computed before the first request leaves, from the workload and its seed alone, so a run
is open-loop (a slow server never slows the arrivals down, as real independent users would not) and
repeatable (the same seed sends the same requests at the same offsets, to the served system or to the
simulator). Each tenant and each purpose draws from its own named random stream, so adding a tenant
or changing the output distribution leaves the other draws as they were.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from common import Priority
from loadtest.words import WORDS
from loadtest.workload import (
    Arrival,
    BurstyArrival,
    ChoiceLength,
    ConstantArrival,
    ConstantLength,
    LengthDist,
    LognormalLength,
    PoissonArrival,
    SweepArrival,
    UniformLength,
    Workload,
)
from protocol.requests import KvShare

# ---- lengths ------------------------------------------------------------------------------------


def sample_length(dist: LengthDist, rng: random.Random) -> int:
    """One length from ``dist``; lognormal draws are rounded and clipped to [min, max]."""
    if isinstance(dist, LognormalLength):
        x = rng.lognormvariate(math.log(dist.median), dist.sigma) if dist.sigma > 0 else dist.median
        return int(min(dist.max, max(dist.min, round(x))))
    if isinstance(dist, UniformLength):
        return rng.randint(dist.min, dist.max)
    if isinstance(dist, ConstantLength):
        return dist.value
    if isinstance(dist, ChoiceLength):
        return rng.choices(dist.values, weights=dist.weights)[0]
    raise TypeError(f"unknown length distribution {dist!r}")


def sample_priority(mix: dict[Priority, float], rng: random.Random) -> Priority:
    classes = sorted(mix, key=lambda p: p.order)  # a stable order: the same seed, the same classes
    return rng.choices(classes, weights=[mix[p] for p in classes])[0]


# ---- arrivals -----------------------------------------------------------------------------------


def poisson_times(rate: float, duration_s: float, rng: random.Random, start_s: float = 0.0) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate``/s on [start_s, start_s + duration_s)."""
    times: list[float] = []
    t = start_s
    end = start_s + duration_s
    if rate <= 0:
        return times
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return times
        times.append(t)


def constant_times(rate: float, duration_s: float, start_s: float = 0.0) -> list[float]:
    """Evenly spaced arrivals, the first half a gap in (so stages of a sweep never share an instant)."""
    gap = 1.0 / rate
    n = math.floor(duration_s * rate + 1e-9)
    return [start_s + (i + 0.5) * gap for i in range(n) if (i + 0.5) * gap < duration_s]


def bursty_times(arrival: BurstyArrival, duration_s: float, rng: random.Random) -> list[float]:
    """On/off Poisson arrivals. A Poisson process is memoryless, so each on or off segment is
    generated on its own at its own rate and the result is exact, not an approximation by thinning."""
    times: list[float] = []
    # Segment boundaries: the burst of period k starts at phase + k * period (bursts may wrap around 0).
    p, b, phase = arrival.period_s, arrival.burst_s, arrival.phase_s % arrival.period_s
    t = 0.0
    while t < duration_s:
        in_period = (t - phase) % p
        if in_period < b:  # inside a burst: until it ends
            seg_end, rate = t + (b - in_period), arrival.burst_rate
        else:  # outside: until the next burst starts
            seg_end, rate = t + (p - in_period), arrival.base_rate
        seg_end = min(max(seg_end, t + 1e-9), duration_s)  # float rounding must never stall the loop
        times += poisson_times(rate, seg_end - t, rng, start_s=t)
        t = seg_end
    return times


def offered_rate(arrival: Arrival, t: float) -> float:
    """The rate the process offers at time ``t`` (for plots of offered against achieved load)."""
    if isinstance(arrival, PoissonArrival | ConstantArrival):
        return arrival.rate
    if isinstance(arrival, BurstyArrival):
        in_period = (t - arrival.phase_s % arrival.period_s) % arrival.period_s
        return arrival.burst_rate if in_period < arrival.burst_s else arrival.base_rate
    raise TypeError("a sweep has a rate per stage, not one process")


def arrival_times(arrival: Arrival, duration_s: float, rng: random.Random) -> list[float]:
    if isinstance(arrival, PoissonArrival):
        return poisson_times(arrival.rate, duration_s, rng)
    if isinstance(arrival, ConstantArrival):
        return constant_times(arrival.rate, duration_s)
    if isinstance(arrival, BurstyArrival):
        return bursty_times(arrival, duration_s, rng)
    raise TypeError("expand a sweep into stages first (plan_workload does)")


def mean_rate(arrival: Arrival) -> float:
    if isinstance(arrival, PoissonArrival | ConstantArrival):
        return arrival.rate
    if isinstance(arrival, BurstyArrival):
        return arrival.mean_rate
    raise TypeError("a sweep has a rate per stage")


# ---- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan: when (offset in its stage), whose, which class, how long."""

    index: int
    stage: int
    at_s: float
    tenant: str
    priority: Priority
    prompt_len: int  # words for the served system; tokens for the simulator
    max_tokens: int
    weight: float = 1.0  # the tenant's fair-share weight (simulator only)
    # Simulator only: the first ``shared_prefix_len`` prompt tokens are the tenant's system prompt,
    # the same in each of its requests; and the tenant's KV floor and cap.
    shared_prefix_len: int = 0
    kv_share: KvShare | None = None


@dataclass(frozen=True)
class Stage:
    """A stretch of constant offered load: the whole run, or one rate of a sweep."""

    index: int
    name: str
    duration_s: float
    offered_rate: float  # mean requests/s offered by the plan's processes
    requests: list[PlannedRequest]


@dataclass(frozen=True)
class Plan:
    stages: list[Stage]
    truncated: bool  # max_requests cut the plan short

    @property
    def requests(self) -> list[PlannedRequest]:
        return [r for s in self.stages for r in s.requests]


def _stream(seed: int, *parts: object) -> random.Random:
    # String seeds hash through SHA-512 in CPython's random: stable across runs and processes.
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def _stage_requests(
    workload: Workload, stage: int, duration_s: float, shared: Arrival | None
) -> list[tuple[float, str]]:
    """(offset, tenant) of every arrival of one stage, time-ordered."""
    arrivals: list[tuple[float, str]] = []
    shared_tenants = [t for t in workload.tenants if t.arrival is None]
    if shared is not None and shared_tenants:
        rng = _stream(workload.seed, "arrivals", stage)
        pick = _stream(workload.seed, "tenant-pick", stage)
        shares = [t.share for t in shared_tenants]
        for at in arrival_times(shared, duration_s, rng):
            arrivals.append((at, pick.choices(shared_tenants, weights=shares)[0].name))
    for t in workload.tenants:
        if t.arrival is not None:
            rng = _stream(workload.seed, "arrivals", stage, t.name)
            arrivals += [(at, t.name) for at in arrival_times(t.arrival, duration_s, rng)]
    arrivals.sort()
    return arrivals


def plan_workload(
    workload: Workload,
    *,
    rate: float | None = None,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> Plan:
    """Every request of the run. ``rate`` replaces the workload-wide rate (Poisson or constant);
    ``duration_s`` and ``max_requests`` override the file's."""
    duration = duration_s or workload.stage_s()
    cap = max_requests if max_requests is not None else workload.max_requests
    shared = workload.arrival
    stage_specs: list[tuple[str, Arrival | None]] = []
    if isinstance(shared, SweepArrival):
        make: Callable[[float], Arrival] = (
            (lambda r: PoissonArrival(rate=r))
            if shared.shape == "poisson"
            else (lambda r: ConstantArrival(rate=r))
        )
        stage_specs = [(f"{r:g} req/s", make(r)) for r in shared.rates]
    else:
        if rate is not None and isinstance(shared, PoissonArrival | ConstantArrival):
            shared = shared.model_copy(update={"rate": rate})
        elif rate is not None:
            raise ValueError("--rate overrides a workload-wide poisson or constant arrival only")
        stage_specs = [("run", shared)]
    tenants = {t.name: t for t in workload.tenants}
    stages: list[Stage] = []
    index = 0
    truncated = False
    for s, (name, arrival) in enumerate(stage_specs):
        offered = sum(mean_rate(t.arrival) for t in workload.tenants if t.arrival is not None)
        if arrival is not None and any(t.arrival is None for t in workload.tenants):
            offered += mean_rate(arrival)
        requests: list[PlannedRequest] = []
        for at, tenant_name in _stage_requests(workload, s, duration, arrival):
            if index >= cap:
                truncated = True
                break
            t = tenants[tenant_name]
            # Per-request draws keyed by the request's index: independent of the arrival draws.
            rng = _stream(workload.seed, "request", index)
            requests.append(
                PlannedRequest(
                    index=index,
                    stage=s,
                    at_s=at,
                    tenant=t.name,
                    priority=sample_priority(t.priorities or workload.priorities, rng),
                    prompt_len=sample_length(t.prompt or workload.prompt, rng),
                    max_tokens=sample_length(t.output or workload.output, rng),
                    weight=t.weight,
                )
            )
            index += 1
        stages.append(Stage(s, name, duration, offered, requests))
        if truncated:
            break
    return Plan(stages, truncated)


# ---- prompt text --------------------------------------------------------------------------------


def prompt_text(n_words: int, index: int, seed: int = 0) -> str:
    """A prompt of ``n_words`` common English words, different for every request (no shared prefix,
    so the prefix cache cannot make one tenant's requests cheaper than the plan says)."""
    rng = _stream(seed, "words", index)
    words = [rng.choice(WORDS) for _ in range(max(1, n_words - 1))]
    return f"#{index} " + " ".join(words) if n_words > 1 else f"#{index}"
