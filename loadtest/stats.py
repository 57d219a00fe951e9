"""The statistics of a load test, as plain functions over request records (no server, no clock).

Definitions, stated once and used by the served-system load test and the simulator alike:

* **TTFT** is measured from a request's *planned* arrival, not from when the client got round to
  sending it: a client falling behind its own schedule would otherwise hide the server's queueing
  (coordinated omission). The client's own lag is reported separately (``send_lag``).
* **ITL** (inter-token latency) is the gap between consecutive streamed chunks of one request, as
  vLLM's serving benchmark counts it; **TPOT** is a request's mean gap per token after the first.
* A request that was sent and never got a first token (deadline, lost, cut off at the end of the
  run) has an infinite TTFT: it is in the percentiles, so overload shows instead of vanishing.
  Refusals (quota, auth, bad request) and requests never sent (client-side drop, run time up) are
  counted by code, not as latencies.
* **Goodput** is requests per second that succeeded with TTFT <= the SLO's ``ttft_s`` and TPOT <= its
  ``itl_s`` (DistServe's definition: a fast answer that streams too slowly is not good).
* **Throughput** counts what was delivered inside the measurement window (the arrival window of the
  stage), so a queue still draining after it does not inflate the rate the server sustained.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OK = "OK"
CLIENT_DROPPED = "CLIENT_DROPPED"  # over max_in_flight: never sent (the client could not keep up)
NOT_SENT = "NOT_SENT"  # planned after the run's max_seconds: never sent
INCOMPLETE = "INCOMPLETE"  # still streaming when the run's time was up; cancelled by the client

# Codes where the server refused the request before any work: counted by code, not timed.
REFUSALS = frozenset(
    {
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "UNIMPLEMENTED",
    }
)
NOT_TIMED = REFUSALS | {CLIENT_DROPPED, NOT_SENT}  # no latency exists for these


@dataclass
class RequestRecord:
    """What happened to one planned request; times are seconds from the start of its stage."""

    index: int
    tenant: str
    priority: str  # the class the client asked for (the tenant's ceiling may lower it server-side)
    scheduled_s: float
    stage: int = 0
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] | None = None  # None: one token per chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # served from the prefix cache (where the server says)
    max_tokens: int = 0
    code: str = OK
    finish_reason: str | None = None
    error: str | None = None
    front: str = ""  # grpc or http ("" where there is no front: the simulator)

    @property
    def timed(self) -> bool:
        """Sent and not refused: it has a latency (infinite if it never got an answer)."""
        return self.code not in NOT_TIMED

    @property
    def ttft(self) -> float | None:
        """Seconds from planned arrival to first token; inf if sent but never answered; None if untimed."""
        if self.first_token_s is not None:
            return self.first_token_s - self.scheduled_s
        return math.inf if self.timed else None

    @property
    def e2e(self) -> float | None:
        if self.code == OK and self.end_s is not None:
            return self.end_s - self.scheduled_s
        return math.inf if self.timed else None

    @property
    def send_lag(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.scheduled_s

    def itl(self) -> list[float]:
        t = self.chunk_times
        return [t[i] - t[i - 1] for i in range(1, len(t))]

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None below two tokens)."""
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    def tokens_by(self, t: float) -> int:
        """Tokens delivered by time ``t`` (stage clock)."""
        k = bisect.bisect_right(self.chunk_times, t)
        return k if self.chunk_tokens is None else sum(self.chunk_tokens[:k])

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "stage": self.stage,
            "tenant": self.tenant,
            "priority": self.priority,
            "scheduled_s": _r(self.scheduled_s),
            "sent_s": _r(self.sent_s),
            "ttft_s": _r(self.ttft),
            "e2e_s": _r(self.e2e),
            "tpot_s": _r(self.tpot),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "max_tokens": self.max_tokens,
            "code": self.code,
            "finish_reason": self.finish_reason,
            "error": self.error,
            **({"front": self.front} if self.front else {}),
        }


def _r(x: float | None, nd: int = 6) -> float | str | None:
    if x is None:
        return None
    if math.isinf(x):
        return "inf"
    return round(x, nd)


# ---- percentiles ---------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's
    default). Infinite values sort last; a percentile touching one is infinite. None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    arr = np.sort(np.fromiter(values, dtype=float))
    n = arr.size
    if n == 0:
        return None
    rank = (n - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, n - 1)
    frac = rank - lo
    a, b = float(arr[lo]), float(arr[hi])
    if frac == 0.0 or a == b:
        return a
    if math.isinf(b):
        return math.inf
    return a + (b - a) * frac


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean, p50, p90, p99 and max of a sample (None entries when it is empty)."""
    arr = np.fromiter(values, dtype=float)
    if arr.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": int(arr.size),
        "mean": float(arr.mean()),
        "p50": percentile(arr, 50),
        "p90": percentile(arr, 90),
        "p99": percentile(arr, 99),
        "max": float(arr.max()),
    }


# ---- goodput and group summaries -------------------------------------------------------------------


@dataclass(frozen=True)
class SloSpec:
    ttft_s: float
    itl_s: float

    def met_by(self, r: RequestRecord) -> bool:
        """Succeeded, first token within ``ttft_s``, mean gap per token within ``itl_s``."""
        if r.code != OK or r.ttft is None or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.itl_s


def _values(records: Iterable[RequestRecord], get: Callable[[RequestRecord], float | None]) -> list[float]:
    out = []
    for r in records:
        v = get(r)
        if v is not None:
            out.append(v)
    return out


def group_summary(records: Sequence[RequestRecord], window_s: float, slo: SloSpec) -> dict[str, Any]:
    """Everything the report shows for one group of requests (all, one tenant, one class...)."""
    codes = Counter(r.code for r in records)
    ok = [r for r in records if r.code == OK]
    itl: list[float] = []
    for r in ok:
        itl += r.itl()
    tokens_in_window = sum(r.tokens_by(window_s) for r in records)
    done_in_window = sum(1 for r in ok if r.end_s is not None and r.end_s <= window_s)
    started_in_window = sum(1 for r in records if r.first_token_s is not None and r.first_token_s <= window_s)
    good = sum(1 for r in records if slo.met_by(r))
    sent = [r for r in records if r.code not in (CLIENT_DROPPED, NOT_SENT)]
    return {
        "requests": len(records),
        "ok": len(ok),
        "codes": dict(sorted(codes.items())),
        "refused": sum(n for c, n in codes.items() if c in REFUSALS),
        "not_sent": codes.get(CLIENT_DROPPED, 0) + codes.get(NOT_SENT, 0),
        "ttft_s": summarize(_values(records, lambda r: r.ttft)),
        "itl_s": summarize(itl),
        "tpot_s": summarize(_values(ok, lambda r: r.tpot)),
        "e2e_s": summarize(_values(records, lambda r: r.e2e)),
        "send_lag_s": summarize(_values(sent, lambda r: r.send_lag)),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "output_tokens": sum(r.completion_tokens for r in records),
        "window_s": window_s,
        "output_tokens_per_s": tokens_in_window / window_s if window_s > 0 else 0.0,
        "requests_per_s": done_in_window / window_s if window_s > 0 else 0.0,
        "started_per_s": started_in_window / window_s if window_s > 0 else 0.0,
        "goodput_rps": good / window_s if window_s > 0 else 0.0,
        "goodput_fraction": good / len(records) if records else 0.0,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
    }


def grouped(records: Sequence[RequestRecord], window_s: float, slo: SloSpec) -> dict[str, Any]:
    """Overall, per tenant, per (requested) priority, and per tenant and priority; per front too
    (``fronts``) when the records went through more than one."""
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    by_prio: dict[str, list[RequestRecord]] = defaultdict(list)
    by_both: dict[str, list[RequestRecord]] = defaultdict(list)
    by_front: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_tenant[r.tenant].append(r)
        by_prio[r.priority].append(r)
        by_both[f"{r.tenant}/{r.priority}"].append(r)
        by_front[r.front].append(r)
    order = {"interactive": 0, "standard": 1, "batch": 2}
    fronts = (
        {"fronts": {k: group_summary(v, window_s, slo) for k, v in sorted(by_front.items())}}
        if len(by_front) > 1
        else {}
    )
    return {
        "overall": group_summary(records, window_s, slo),
        "tenants": {k: group_summary(v, window_s, slo) for k, v in sorted(by_tenant.items())},
        "priorities": {
            k: group_summary(v, window_s, slo)
            for k, v in sorted(by_prio.items(), key=lambda kv: order.get(kv[0], 9))
        },
        "tenant_priority": {k: group_summary(v, window_s, slo) for k, v in sorted(by_both.items())},
        **fronts,
    }


# ---- rate sweeps -----------------------------------------------------------------------------------


def sweep_point(
    offered_rate: float, records: Sequence[RequestRecord], window_s: float, slo: SloSpec
) -> dict[str, Any]:
    """One stage of a sweep reduced to the numbers a knee plot needs."""
    s = group_summary(records, window_s, slo)
    return {
        "offered_rps": offered_rate,
        "ttft_growth": ttft_growth(records, window_s),
        "planned_rps": len(records) / window_s if window_s > 0 else 0.0,  # the draw, Poisson noise included
        "achieved_rps": s["requests_per_s"],
        "started_rps": s["started_per_s"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "itl_p50_s": s["itl_s"]["p50"],
        "itl_p99_s": s["itl_s"]["p99"],
        "goodput_rps": s["goodput_rps"],
        "goodput_fraction": s["goodput_fraction"],
        "requests": s["requests"],
        "refused": s["refused"],
    }


def _credible_slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope shrunk towards zero by two standard errors (zero if within them): a
    drift the data cannot tell from noise is no drift."""
    x, y = np.asarray(xs), np.asarray(ys)
    slope, intercept = np.polyfit(x, y, 1)
    n = len(x)
    resid = y - (slope * x + intercept)
    sxx = float(((x - x.mean()) ** 2).sum())
    se = math.sqrt(float((resid**2).sum()) / (n - 2) / sxx) if n > 2 and sxx > 0 else math.inf
    return float(math.copysign(max(0.0, abs(slope) - 2 * se), slope))


def ttft_growth(records: Sequence[RequestRecord], window_s: float) -> float | None:
    """How fast TTFT drifts with arrival time over the last two thirds of the window (the first third
    is the warm-up from an idle server), in seconds per second, per priority class: the least-squares
    slope less two standard errors (static batching's TTFTs swing by a whole cohort's length, so a
    slope alone is noise at low rates); the class drifting most, with its sign. A queue growing
    because arrivals exceed service by 5% drifts up at about 0.05; a class starved by strict priority
    drifts *down* (its requests are all served once the higher classes stop arriving, whenever they
    came). None with fewer than 10 answered requests in every class; inf if one was never answered."""
    by_class: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in records:
        t = r.ttft
        if t is not None and window_s / 3 <= r.scheduled_s < window_s:
            if math.isinf(t):
                return math.inf
            xs, ys = by_class[r.priority]
            xs.append(r.scheduled_s)
            ys.append(t)
    slopes = [_credible_slope(xs, ys) for xs, ys in by_class.values() if len(xs) >= 10 and max(xs) > min(xs)]
    return max(slopes, key=abs) if slopes else None


def keeps_up(point: dict[str, Any], min_efficiency: float = 0.95) -> bool:
    """The server's queue is not growing: it answers every request eventually (p99 TTFT finite), and
    either starts (first token) at least ``min_efficiency`` of the requests that arrived in the window
    (the plan's draw, else the offered rate) inside it, or no class's TTFT drifts by more than
    ``1 - min_efficiency`` seconds per second of arrivals (``ttft_growth``). Requests *started*, not
    completed, because a long-tailed output can take longer than a short window to finish at any load;
    the growth because static batching leaves a cohort's worth of arrivals waiting at the end of any
    window, however stable its queue."""
    p99 = point.get("ttft_p99_s")
    if p99 is None or math.isinf(p99):
        return False
    rate = point.get("started_rps", point["achieved_rps"])
    planned = point.get("planned_rps", point["offered_rps"])  # what was actually drawn, if known
    if rate >= min_efficiency * planned:
        return True
    growth = point.get("ttft_growth")
    return growth is not None and abs(growth) <= 1 - min_efficiency


def find_knee(
    points: Sequence[dict[str, Any]], ttft_p99_slo_s: float, min_efficiency: float = 0.95
) -> dict[str, Any] | None:
    """The highest offered rate the system keeps up with (``keeps_up``) while p99 TTFT stays within
    the SLO, at that rate and every lower one. Past the knee queues grow without bound, so latency,
    not throughput, gives way first. ``ttft_p99_slo_s=inf`` gives the highest rate sustained at all.
    Points are taken in increasing offered rate; the first failing point ends the search."""
    knee = None
    for p in sorted(points, key=lambda p: p["offered_rps"]):
        p99 = p.get("ttft_p99_s")
        if not keeps_up(p, min_efficiency) or p99 is None or p99 > ttft_p99_slo_s:
            break
        knee = p
    return knee


def timeline(records: Sequence[RequestRecord], bin_s: float, end_s: float) -> dict[str, list[float]]:
    """Per-bin output tokens/s and median TTFT (by planned arrival): latency over time for plots."""
    n = max(1, math.ceil(end_s / bin_s))
    tokens = [0.0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        for i, t in enumerate(r.chunk_times):
            b = int(t // bin_s)
            if 0 <= b < n:
                tokens[b] += 1 if r.chunk_tokens is None else r.chunk_tokens[i]
        v = r.ttft
        b = int(r.scheduled_s // bin_s)
        if v is not None and 0 <= b < n:
            ttfts[b].append(v)
    return {
        "t_s": [(i + 0.5) * bin_s for i in range(n)],
        "output_tokens_per_s": [x / bin_s for x in tokens],
        "ttft_p50_s": [percentile(v, 50) if v else math.nan for v in ttfts],  # type: ignore[misc]
    }
