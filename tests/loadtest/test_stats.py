"""The load test's statistics on hand-made records: percentiles, goodput, windows, the knee."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.stats import (
    CLIENT_DROPPED,
    INCOMPLETE,
    OK,
    RequestRecord,
    SloSpec,
    find_knee,
    group_summary,
    grouped,
    keeps_up,
    percentile,
    summarize,
    ttft_growth,
)


def rec(
    i: int,
    *,
    at: float = 0.0,
    chunks: list[float] | None = None,
    code: str = OK,
    tenant: str = "t",
    priority: str = "standard",
) -> RequestRecord:
    chunks = chunks or []
    return RequestRecord(
        index=i,
        tenant=tenant,
        priority=priority,
        scheduled_s=at,
        sent_s=at,
        first_token_s=chunks[0] if chunks else None,
        end_s=(chunks[-1] if chunks else at) if code != INCOMPLETE else None,
        chunk_times=chunks,
        completion_tokens=len(chunks),
        code=code,
    )


def test_percentile_interpolates_linearly_between_ranks_as_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_an_infinite_latency_makes_the_percentiles_that_touch_it_infinite() -> None:
    xs = [0.1] * 99 + [math.inf]
    assert percentile(xs, 50) == pytest.approx(0.1)
    assert percentile(xs, 98) == pytest.approx(0.1)
    assert percentile(xs, 99.5) == math.inf  # between the last finite value and inf
    s = summarize(xs)
    assert s["n"] == 100 and s["max"] == math.inf and s["p50"] == pytest.approx(0.1)


def test_ttft_counts_from_the_planned_arrival_and_never_answered_is_infinite() -> None:
    late = rec(0, at=1.0, chunks=[1.5, 1.6])
    late.sent_s = 1.3  # the client itself sent 0.3 s late: still charged to TTFT (open loop)
    assert late.ttft == pytest.approx(0.5)
    assert late.send_lag == pytest.approx(0.3)
    assert rec(1, at=1.0, code=INCOMPLETE).ttft == math.inf
    assert rec(2, at=1.0, code="DEADLINE_EXCEEDED").ttft == math.inf
    assert rec(3, code="RESOURCE_EXHAUSTED").ttft is None  # refused: counted by code, not timed
    assert rec(4, code=CLIENT_DROPPED).ttft is None


def test_itl_is_the_gap_between_chunks_and_tpot_the_mean_after_the_first() -> None:
    r = rec(0, chunks=[0.2, 0.25, 0.35, 0.5])
    assert r.itl() == pytest.approx([0.05, 0.1, 0.15])
    assert r.tpot == pytest.approx(0.1)  # (0.5 - 0.2) / 3
    assert rec(1, chunks=[0.2]).tpot is None


def test_goodput_needs_success_ttft_and_tpot_within_the_slo() -> None:
    slo = SloSpec(ttft_s=0.5, itl_s=0.1)
    records = [
        rec(0, chunks=[0.2, 0.3, 0.4]),  # good: TTFT 0.2, TPOT 0.1
        rec(1, chunks=[0.6, 0.7]),  # TTFT too slow
        rec(2, chunks=[0.1, 0.5]),  # TPOT 0.4 too slow
        rec(3, code="RESOURCE_EXHAUSTED"),
        rec(4, chunks=[0.1], code=INCOMPLETE),
        rec(5, chunks=[0.3]),  # one token: no TPOT, good on TTFT alone
    ]
    assert [slo.met_by(r) for r in records] == [True, False, False, False, False, True]
    g = group_summary(records, window_s=2.0, slo=slo)
    assert g["goodput_rps"] == pytest.approx(1.0)  # 2 good requests in a 2 s window
    assert g["goodput_fraction"] == pytest.approx(2 / 6)
    assert g["codes"] == {INCOMPLETE: 1, OK: 4, "RESOURCE_EXHAUSTED": 1}
    assert g["refused"] == 1
    assert g["ttft_s"]["n"] == 5  # the refusal has no latency; the incomplete one does (0.1)


def test_throughput_counts_only_what_arrived_inside_the_window() -> None:
    records = [rec(0, chunks=[0.5, 1.0, 1.5]), rec(1, at=0.9, chunks=[1.9, 2.5, 3.0])]
    g = group_summary(records, window_s=2.0, slo=SloSpec(1, 1))
    assert g["output_tokens_per_s"] == pytest.approx(4 / 2.0)  # 3 + 1 tokens by t=2
    assert g["requests_per_s"] == pytest.approx(1 / 2.0)  # only request 0 finished by t=2
    assert g["started_per_s"] == pytest.approx(2 / 2.0)


def test_grouping_by_tenant_priority_and_both() -> None:
    records = [
        rec(0, chunks=[0.1], tenant="a", priority="interactive"),
        rec(1, chunks=[0.1], tenant="a", priority="batch"),
        rec(2, chunks=[0.1], tenant="b", priority="batch"),
    ]
    g = grouped(records, 1.0, SloSpec(1, 1))
    assert g["overall"]["requests"] == 3
    assert {k: v["requests"] for k, v in g["tenants"].items()} == {"a": 2, "b": 1}
    assert list(g["priorities"]) == ["interactive", "batch"]  # service order, not the alphabet
    assert set(g["tenant_priority"]) == {"a/interactive", "a/batch", "b/batch"}


def _point(rate: float, started: float, p99: float) -> dict[str, float]:
    return {
        "offered_rps": rate,
        "planned_rps": rate,
        "started_rps": started,
        "achieved_rps": started,
        "ttft_p99_s": p99,
    }


def test_the_knee_is_the_last_rate_kept_up_with_inside_the_slo() -> None:
    points = [
        _point(4, 4, 0.05),
        _point(2, 2, 0.04),  # order does not matter
        _point(8, 7.9, 0.4),
        _point(12, 11.5, 2.0),  # keeps up, but p99 over a 1 s SLO
        _point(16, 12.0, math.inf),  # queue growing: not kept up with
    ]
    assert find_knee(points, ttft_p99_slo_s=1.0)["offered_rps"] == 8
    assert find_knee(points, ttft_p99_slo_s=math.inf)["offered_rps"] == 12  # highest rate sustained
    assert find_knee([_point(2, 2, 3.0)], 1.0) is None
    assert not keeps_up(_point(10, 9.0, 0.1))  # started 90% < 95% of what arrived
    assert keeps_up({**_point(10, 9.6, 0.1), "planned_rps": 9.8})


def test_a_stable_queue_with_long_cohorts_keeps_up_by_its_ttft_growth() -> None:
    # Static batching: a cohort's worth of arrivals waits past the window's end even when stable.
    stable = {**_point(5, 4.2, 30.0), "ttft_growth": 0.01}
    growing = {**_point(8, 6.9, 40.0), "ttft_growth": 0.3}
    starving = {**_point(8, 6.9, 40.0), "ttft_growth": -0.4}
    assert keeps_up(stable) and not keeps_up(growing) and not keeps_up(starving)
    assert find_knee([stable, growing], math.inf)["offered_rps"] == 5


def test_ttft_growth_is_the_queue_growth_rate() -> None:
    # Arrivals every 0.1 s for 30 s, served at a rate that makes each wait 0.2 s longer per second.
    records = [rec(i, at=0.1 * i, chunks=[0.1 * i + 0.5 + 0.2 * 0.1 * i]) for i in range(300)]
    assert ttft_growth(records, 30.0) == pytest.approx(0.2)  # exact line: no standard error to take off
    # TTFTs swinging 0-20 s with no trend (static cohorts): the noisy slope is no credible drift.
    rng = random.Random(4)
    noisy = [rec(i, at=3.0 * i, chunks=[3.0 * i + rng.uniform(0, 20)]) for i in range(40)]
    assert ttft_growth(noisy, 120.0) == 0.0
    flat = [rec(i, at=0.1 * i, chunks=[0.1 * i + 0.5]) for i in range(300)]
    assert ttft_growth(flat, 30.0) == pytest.approx(0.0, abs=1e-9)
    # A starved class: all served at t=40 whenever it arrived; the class drifting most is reported.
    starved = [*flat, *(rec(1000 + i, at=10 + i, chunks=[40.0], priority="batch") for i in range(20))]
    assert ttft_growth(starved, 30.0) == pytest.approx(-1.0)
    lost = [*flat, rec(300, at=25.0, code=INCOMPLETE)]
    assert ttft_growth(lost, 30.0) == math.inf
    assert ttft_growth(flat[:5], 30.0) is None
