"""Utilization from the engines' counters, on hand-computed scrapes: increases across restarts, the
figures of docs/utilization.md per replica and over several, windows, and the exposition the gateway
really writes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common import Priority
from gateway.metrics import EngineCollector
from loadtest.prometheus import (
    BUSY,
    CAPACITY,
    COMPUTED_TOKENS,
    COUNTERS,
    KV_BLOCKS_TOTAL,
    KV_BLOCKS_USED,
    RECOMPUTED_TOKENS,
    RUNNING,
    STEP_BYTES,
    STEP_SECONDS,
    STEP_SEQ_SECONDS,
    STEPS,
    WAITING,
    counter_increase,
    parse_engine_metrics,
    replica_window,
    restarted,
    series,
    summarize_samples,
    utilization,
    utilization_figures,
    utilization_series,
)
from protocol.stats import EngineStats


def scrape(
    step_s: float,
    seq_s: float,
    computed: float,
    recomputed: float = 0.0,
    nbytes: float = 0.0,
    steps: float = 0.0,
    kv_used: float = 0.0,
    kv_total: float = 10.0,
    capacity: float = 8.0,
) -> dict[str, float]:
    return {
        STEP_SECONDS: step_s,
        STEP_SEQ_SECONDS: seq_s,
        COMPUTED_TOKENS: computed,
        RECOMPUTED_TOKENS: recomputed,
        STEP_BYTES: nbytes,
        STEPS: steps,
        KV_BLOCKS_USED: kv_used,
        KV_BLOCKS_TOTAL: kv_total,
        CAPACITY: capacity,
    }


# Three scrapes one second apart of a replica with capacity 8. Over the 2 s: 1.5 s in steps (busy
# 0.75); 6 live-sequence seconds over those 1.5 step seconds is 4 sequences a step on average, of 8
# slots (occupancy 0.5); 300 tokens computed, 60 recomputed (useful 0.8); 3 GB moved
# (1.5 GB/s of wall time, 2 GB/s of step time); 30 steps (15 steps/s, 50 ms each); KV 2, 4, 6 of 10.
POINTS = [
    (0.0, scrape(0.0, 0.0, 0, 0, 0, 0, kv_used=2)),
    (1.0, scrape(0.5, 2.0, 100, 0, 1e9, 10, kv_used=4)),
    (2.0, scrape(1.5, 6.0, 300, 60, 3e9, 30, kv_used=6)),
]


def test_a_counter_increase_is_the_sum_of_its_steps_and_a_drop_is_a_restart() -> None:
    assert counter_increase([10, 15, 25]) == 15
    assert counter_increase([7]) == 0
    assert counter_increase([]) == 0
    # 10 -> 15 (+5), restart: 15 -> 3 counts the new process's 3, then 3 -> 8 (+5)
    assert counter_increase([10, 15, 3, 8]) == 13
    # A restart seen on another counter: this one (12 -> 14) began again at zero too, so +14, not +2.
    assert counter_increase([10, 12, 14], restarts=[False, True]) == 16
    # A restart to exactly zero, then nothing: the increase after it is zero.
    assert counter_increase([5, 0, 0]) == 0


def test_a_replica_restarted_when_any_of_its_counters_went_down() -> None:
    a = scrape(10.0, 40.0, 1000, steps=100)
    b = scrape(11.0, 44.0, 1100, steps=110)
    c = scrape(0.4, 1.0, 90, steps=4)  # a new process
    d = {**scrape(0.9, 3.0, 200, steps=9), STEP_SECONDS: 12.0}  # only step seconds looks as if it grew
    assert restarted([a, b, c]) == [False, True]
    assert restarted([b, d]) == [True]
    assert restarted([a]) == []


def test_figures_of_one_replica_by_hand() -> None:
    w = replica_window(POINTS)
    assert w is not None
    assert (w.wall_s, w.scrapes, w.restarts) == (2.0, 3, 0)
    assert w.step_seconds == 1.5 and w.step_seq_seconds == 6.0 and w.slot_seconds == 12.0
    f = utilization_figures([w], copy_bandwidth_gbs=4.0)
    assert f["busy_fraction"] == pytest.approx(0.75)
    assert f["slot_occupancy"] == pytest.approx(0.5)
    assert f["useful_token_fraction"] == pytest.approx(0.8)
    assert f["kv_blocks_in_use"] == pytest.approx(0.4)
    assert f["kv_blocks_in_use_max"] == pytest.approx(0.6)
    assert f["steps_per_s"] == pytest.approx(15.0)
    assert f["mean_step_s"] == pytest.approx(0.05)
    assert f["computed_tokens_per_s"] == pytest.approx(150.0)
    assert f["gb_per_s_wall"] == pytest.approx(1.5)
    assert f["gb_per_s_busy"] == pytest.approx(2.0)
    assert f["mbu"] == pytest.approx(0.5)  # 2 GB/s while stepping over a 4 GB/s copy
    assert f["mbu_wall"] == pytest.approx(0.375)  # 1.5 GB/s of wall time over 4 GB/s


def test_without_a_copy_bandwidth_mbu_is_empty_and_bytes_are_still_reported() -> None:
    w = replica_window(POINTS)
    assert w is not None
    f = utilization_figures([w])
    assert f["mbu"] is None and f["mbu_wall"] is None and f["copy_bandwidth_gbs"] is None
    assert f["gb_per_s_wall"] == pytest.approx(1.5)


def test_a_restart_inside_the_window_counts_the_new_process_from_its_new_values() -> None:
    points = [
        (0.0, scrape(100.0, 400.0, 5000, steps=1000)),
        (1.0, scrape(100.5, 402.0, 5100, steps=1010)),
        # restarted: the new process spent 0.25 s stepping with 1 sequence, 20 tokens, 5 steps
        (2.0, scrape(0.25, 0.25, 20, steps=5)),
        (3.0, scrape(0.75, 1.25, 60, steps=15)),
    ]
    w = replica_window(points)
    assert w is not None
    assert w.restarts == 1
    assert w.step_seconds == pytest.approx(0.5 + 0.25 + 0.5)
    assert w.step_seq_seconds == pytest.approx(2.0 + 0.25 + 1.0)
    assert w.computed_tokens == 100 + 20 + 40
    assert w.steps == 10 + 5 + 10
    f = utilization_figures([w])
    assert f["busy_fraction"] == pytest.approx(1.25 / 3)
    assert f["restarts"] == 1


def test_several_replicas_sum_replica_seconds() -> None:
    a = replica_window(POINTS)
    # A second replica, capacity 4, idle but for 0.5 s with 1 sequence; no waste.
    b = replica_window(
        [(0.0, scrape(0.0, 0.0, 0, capacity=4)), (2.0, scrape(0.5, 0.5, 50, capacity=4, kv_used=1))]
    )
    assert a is not None and b is not None
    f = utilization_figures([a, b], copy_bandwidth_gbs=4.0)
    assert f["replicas"] == 2
    assert f["busy_fraction"] == pytest.approx((1.5 + 0.5) / (2 + 2))
    assert f["slot_occupancy"] == pytest.approx((6.0 + 0.5) / (1.5 * 8 + 0.5 * 4))
    assert f["useful_token_fraction"] == pytest.approx(1 - 60 / 350)
    assert f["kv_blocks_in_use"] == pytest.approx((4 + 0.5) / 20)  # mean blocks used / blocks
    assert f["gb_per_s_wall"] == pytest.approx(1.5)  # the second replica moved nothing
    assert f["gb_per_s_busy"] == pytest.approx(3.0 / 2.0)  # 3 GB over 2 step seconds
    assert f["mbu"] == pytest.approx(1.5 / 4.0)


def test_fractions_are_capped_at_one_and_the_raw_value_is_kept() -> None:
    # The counters are as of each replica's latest step: over a short window they can run ahead of
    # the scrape clock by up to a step.
    w = replica_window([(0.0, scrape(0.0, 0.0, 0)), (1.0, scrape(1.05, 6.0, 10, capacity=8))])
    assert w is not None
    f = utilization_figures([w])
    assert f["busy_fraction"] == 1.0
    assert f["busy_fraction_raw"] == pytest.approx(1.05)
    assert f["slot_occupancy"] == pytest.approx(6.0 / 1.05 / 8)


def test_an_idle_replica_has_zero_busy_and_no_occupancy_or_useful_fraction() -> None:
    w = replica_window([(0.0, scrape(3.0, 9.0, 300)), (5.0, scrape(3.0, 9.0, 300))])
    assert w is not None
    f = utilization_figures([w])
    assert f["busy_fraction"] == 0.0
    assert f["slot_occupancy"] is None and f["useful_token_fraction"] is None and f["mean_step_s"] is None


def test_utilization_keeps_the_window_and_names_replicas_it_cannot_measure() -> None:
    samples = [(t, {"pool/a": v, **({"pool/late": scrape(0, 0, 0)} if t == 2.0 else {})}) for t, v in POINTS]
    samples.append((9.0, {"pool/a": scrape(9.0, 9.0, 9000)}))  # after the window: left out
    u = utilization(samples, 0.0, 2.0, copy_bandwidth_gbs=4.0)
    assert set(u["replicas"]) == {"pool/a"} and u["skipped"] == ["pool/late"]
    assert u["all"] is None  # one replica measured: its own row says it all
    a = u["replicas"]["pool/a"]
    assert a["busy_fraction"] == pytest.approx(0.75) and a["mbu"] == pytest.approx(0.5)
    assert a["step_seconds"] == 1.5  # the raw increases travel with the figures
    assert utilization([], 0.0, 2.0)["replicas"] == {}


def test_utilization_series_gives_busy_and_occupancy_per_interval() -> None:
    s = utilization_series([(t, {"pool/a": v}) for t, v in POINTS])
    ts, busy = s["pool/a"]["step_busy"]
    assert ts == [0.5, 1.5] and busy == pytest.approx([0.5, 1.0])
    assert s["pool/a"]["slot_occupancy"][1] == pytest.approx([2.0 / 0.5 / 8, 4.0 / 1.0 / 8])


def test_the_gateways_exposition_parses_into_the_scraped_names() -> None:
    stats = EngineStats(
        running={Priority.STANDARD: 3},
        waiting={Priority.BATCH: 2, Priority.INTERACTIVE: 1},
        kv_blocks_used=5,
        kv_blocks_total=20,
        max_num_seqs=8,
        num_steps=42,
        computed_tokens=900,
        recomputed_tokens=3,
        step_seconds=1.25,
        step_seq_seconds=3.5,
        step_bytes=123_456_789,
        busy_fraction=0.5,
    )
    collector = EngineCollector()
    collector.add_source(1, lambda: [("pool0", "tiny", "r1", stats)])
    registry = CollectorRegistry()
    registry.register(collector)
    parsed = parse_engine_metrics(generate_latest(registry).decode())
    v = parsed["pool0/r1"]
    assert v[RUNNING] == 3 and v[WAITING] == 3 and v[BUSY] == 0.5
    assert {n: v[n] for n in COUNTERS} == {
        STEP_SECONDS: 1.25,
        STEP_SEQ_SECONDS: 3.5,
        COMPUTED_TOKENS: 900,
        RECOMPUTED_TOKENS: 3,
        STEP_BYTES: 123_456_789,
        STEPS: 42,
    }
    assert (v[CAPACITY], v[KV_BLOCKS_USED], v[KV_BLOCKS_TOTAL]) == (8, 5, 20)
    # The gauge summary and plots keep to the gauges; counters are for utilization only.
    samples = [(0.0, parsed), (1.0, parsed)]
    assert set(summarize_samples(samples)["pool0/r1"]) == {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "engine_busy_fraction",
    }
    assert set(series(samples)["pool0/r1"]) == set(summarize_samples(samples)["pool0/r1"])
