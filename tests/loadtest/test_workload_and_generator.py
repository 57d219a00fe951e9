"""Workload files (and their errors) and the seeded plan: arrivals, lengths, priorities."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from pathlib import Path

import pytest

from common import Priority
from loadtest.generator import (
    bursty_times,
    constant_times,
    plan_workload,
    poisson_times,
    prompt_text,
    sample_length,
)
from loadtest.workload import (
    BurstyArrival,
    LognormalLength,
    WorkloadError,
    load_workload,
    parse_workload,
)

WORKLOADS = Path(__file__).resolve().parents[2] / "loadtest" / "workloads"

GOOD = """
name: two-tenants
target: {address: "127.0.0.1:50051", model: tiny, metrics_url: null}
seed: 7
duration_s: 20
arrival: {process: poisson, rate: 5}
priorities: {interactive: 1, batch: 3}
prompt: {dist: uniform, min: 4, max: 8}
output: {dist: lognormal, median: 32, sigma: 1.2, min: 4, max: 128}
tenants:
  - {name: acme, api_key_env: ACME_KEY, share: 3}
  - name: globex
    api_key: loom_x
    arrival: {process: bursty, base_rate: 1, burst_rate: 10, period_s: 10, burst_s: 2, phase_s: 5}
"""


def test_a_workload_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(GOOD)
    w = load_workload(path)
    assert w.name == "two-tenants" and w.target.metrics_url is None
    assert w.priorities == {Priority.INTERACTIVE: 1.0, Priority.BATCH: 3.0}
    assert isinstance(w.tenants[1].arrival, BurstyArrival)
    assert w.resolve_keys(env={"ACME_KEY": "k1"}) == {"acme": "k1", "globex": "loom_x"}
    assert w.resolve_keys({"acme": "flag"}, env={}) == {"acme": "flag", "globex": "loom_x"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ntenants: [{name: a}]\narrival: {process: poisson, rate: -1}\n", "arrival.poisson.rate"),
        (
            "name: x\ntenants: [{name: a, arival: {}}]\narrival: {process: poisson, rate: 1}\n",
            "tenants.0.arival",
        ),
        (
            "name: x\ntenants: [{name: a, priorities: {urgent: 1}}]\narrival: {process: poisson, rate: 1}\n",
            "urgent",
        ),
        ("name: x\ntenants: [{name: a}]\n", "no arrival of their own and the workload has none"),
        ("name: x\ntenants: [{name: a}, {name: a}]\narrival: {process: poisson, rate: 1}\n", "repeated: a"),
        (
            "name: x\ntenants: [{name: a}]\narrival: {process: poisson, rate: 1}\n"
            "output: {dist: lognormal, median: 8, sigma: 1, min: 9, max: 4}\n",
            "max (4) is below min (9)",
        ),
        (
            "name: x\ntenants: [{name: a, arrival: {process: sweep, rates: [1]}}]\n",
            "a sweep is workload-wide",
        ),
        (
            "name: x\narrival: {process: bursty, burst_rate: 3, period_s: 5, burst_s: 9}\n"
            "tenants: [{name: a}]\n",
            "burst_s (9.0) is longer than period_s (5.0)",
        ),
        ("name: x\ntenants: []\narrival: {process: poisson, rate: 1}\n", "tenants"),
        ("name: x\nfront: rest\ntenants: [{name: a}]\narrival: {process: poisson, rate: 1}\n", "front"),
        (
            "name: x\ntarget: {driver: grpc}\ntenants: [{name: a}]\narrival: {process: poisson, rate: 1}\n",
            "'front: grpc|http'",
        ),
    ],
)
def test_bad_workloads_fail_with_the_field_named(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError) as err:
        load_workload(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_unreadable_and_malformed_files_say_where(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.yaml")
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ntenants: [\n  - {name: a\n")
    with pytest.raises(WorkloadError, match=r"not valid YAML at line \d+"):
        load_workload(path)
    with pytest.raises(WorkloadError, match="top level must be a mapping"):
        parse_workload(["a", "list"])


def test_missing_keys_are_named_per_tenant() -> None:
    w = parse_workload(
        {
            "name": "x",
            "arrival": {"process": "poisson", "rate": 1},
            "tenants": [{"name": "a", "api_key_env": "NOPE"}],
        }
    )
    with pytest.raises(WorkloadError, match=r"a \(\$NOPE is unset\)"):
        w.resolve_keys(env={})
    with pytest.raises(WorkloadError, match="not in the workload: b"):
        w.resolve_keys({"b": "k"}, env={})


def test_the_front_is_the_tenants_own_else_the_workloads() -> None:
    base = {"name": "x", "arrival": {"process": "poisson", "rate": 1}}
    w = parse_workload({**base, "tenants": [{"name": "a"}, {"name": "b", "front": "http"}]})
    assert w.front == "grpc" and w.fronts == {"a": "grpc", "b": "http"}
    assert w.front_of("b") == "http" and w.target.http_address == "127.0.0.1:8000"
    w = parse_workload({**base, "front": "http", "tenants": [{"name": "a"}, {"name": "b", "front": "grpc"}]})
    assert w.fronts == {"a": "http", "b": "grpc"}
    with pytest.raises(KeyError):
        w.front_of("nobody")


def test_the_front_flag_sends_every_tenant_through_one_front(tmp_path: Path) -> None:
    from loadtest.loadtest_cli import _overrides, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    path = tmp_path / "w.yaml"
    path.write_text(GOOD.replace("  - {name: acme,", "  - {front: http, name: acme,"))
    w = load_workload(path)
    assert w.fronts == {"acme": "http", "globex": "grpc"}
    args = parser.parse_args(["loadtest", str(path), "--front", "http", "--http-address", "127.0.0.1:9000"])
    flagged = _overrides(w, args, str(path))
    assert flagged.fronts == {"acme": "http", "globex": "http"}
    assert flagged.target.http_address == "127.0.0.1:9000"
    args = parser.parse_args(["loadtest", str(path), "--front", "grpc"])
    assert _overrides(w, args, str(path)).fronts == {"acme": "grpc", "globex": "grpc"}


def test_every_shipped_workload_parses() -> None:
    files = sorted(WORKLOADS.glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        plan = plan_workload(load_workload(path))
        assert plan.requests, path


@pytest.mark.parametrize("rate", [2.0, 20.0])
def test_poisson_arrivals_have_the_mean_rate_and_exponential_gaps(rate: float) -> None:
    duration = 2000.0 / rate  # ~2000 arrivals
    times = poisson_times(rate, duration, random.Random(11))
    assert all(0 <= a < b < duration for a, b in itertools.pairwise(times))
    # Count ~ Poisson(2000): sd 45, so 5% is over 4 sd.
    assert len(times) / duration == pytest.approx(rate, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(statistics.fmean(gaps), rel=0.08)


def test_constant_and_bursty_arrivals() -> None:
    assert constant_times(2.0, 3.0) == [0.25, 0.75, 1.25, 1.75, 2.25, 2.75]
    a = BurstyArrival(base_rate=0.0, burst_rate=50.0, period_s=10.0, burst_s=2.0, phase_s=3.0)
    times = bursty_times(a, 1000.0, random.Random(5))
    assert all((t - 3.0) % 10.0 < 2.0 for t in times)  # only inside [3, 5) of every period
    assert len(times) / 1000.0 == pytest.approx(a.mean_rate, rel=0.05)  # 10 req/s on average


def test_lognormal_lengths_are_clipped_and_keep_their_median() -> None:
    dist = LognormalLength(median=40, sigma=1.2, min=8, max=200)
    rng = random.Random(3)
    xs = [sample_length(dist, rng) for _ in range(20000)]
    assert min(xs) == 8 and max(xs) == 200  # both ends reached and never passed
    assert statistics.median(xs) == pytest.approx(40, rel=0.05)
    # P(lognormal > 200) = P(Z > ln(5)/1.2) = 9.0%: the clipped mass sits on the bound.
    assert xs.count(200) / len(xs) == pytest.approx(0.090, abs=0.01)
    assert xs.count(8) / len(xs) == pytest.approx(0.090, abs=0.01)  # symmetric: ln(40/8) = ln(5)


def test_the_plan_is_seeded_and_splits_tenants_by_share() -> None:
    w = parse_workload(
        {
            "name": "x",
            "seed": 1,
            "duration_s": 400,
            "max_requests": 100000,
            "arrival": {"process": "poisson", "rate": 10},
            "priorities": {"interactive": 1, "batch": 1},
            "tenants": [{"name": "a", "share": 3}, {"name": "b"}],
        }
    )
    p1, p2 = plan_workload(w), plan_workload(w)
    assert p1.requests == p2.requests  # same seed, same requests
    n = len(p1.requests)
    assert sum(r.tenant == "a" for r in p1.requests) / n == pytest.approx(0.75, abs=0.02)
    assert sum(r.priority is Priority.INTERACTIVE for r in p1.requests) / n == pytest.approx(0.5, abs=0.02)
    other = plan_workload(w.model_copy(update={"seed": 2}))
    assert other.requests != p1.requests
    capped = plan_workload(w, max_requests=50)
    assert len(capped.requests) == 50 and capped.truncated
    faster = plan_workload(w, rate=20, duration_s=100)
    assert len(faster.requests) / 100 == pytest.approx(20, rel=0.1)


def test_a_sweep_plans_one_stage_per_rate() -> None:
    w = parse_workload(
        {
            "name": "x",
            "arrival": {"process": "sweep", "rates": [1, 4], "stage_s": 50},
            "tenants": [{"name": "a"}],
        }
    )
    plan = plan_workload(w)
    assert [s.offered_rate for s in plan.stages] == [1, 4]
    assert [s.duration_s for s in plan.stages] == [50, 50]
    assert all(r.stage == s.index for s in plan.stages for r in s.requests)
    assert len(plan.stages[1].requests) > len(plan.stages[0].requests)


def test_prompts_have_the_planned_words_and_no_shared_prefix() -> None:
    a, b = prompt_text(12, 0), prompt_text(12, 1)
    assert len(a.split()) == 12 and len(b.split()) == 12
    assert a.split()[0] != b.split()[0]  # the request number leads: no prefix-cache sharing
