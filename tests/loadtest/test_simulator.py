"""The simulator's accounting on workloads small enough to follow step by step."""

from __future__ import annotations

import math

import pytest

from common import Priority
from loadtest.costmodel import Deployment, Hardware, ModelShape
from loadtest.generator import PlannedRequest
from loadtest.simulator import EngineSpec, Simulator
from loadtest.static_batching import Batching
from loadtest.stats import INCOMPLETE, OK

TOY = ModelShape("toy", 8, 16, 2, 2, 1, 4, 10, False, 64)
# Memory and compute are free: every step costs exactly the 1 s host term, so time counts steps.
ONE_SECOND_STEPS = Hardware("clock", 1e30, 1e30, 10**9, 2, host_step_s=1.0, activation_reserve_bytes=0)
DEP = Deployment(TOY, ONE_SECOND_STEPS)


def req(i: int, prompt: int, out: int, at: float = 0.0) -> PlannedRequest:
    return PlannedRequest(i, 0, at, "t", Priority.STANDARD, prompt, out)


def spec(**kw: object) -> EngineSpec:
    base: dict[str, object] = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=32,
        max_model_len=16,
        client_cap_tokens=8,
    )
    return EngineSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_paged_and_contiguous_kv_accounting_by_hand() -> None:
    # A: 5-token prompt, 3 tokens out (8 in all); B: 2-token prompt, 1 token out (3 in all).
    res = Simulator(DEP, spec()).run([req(0, 5, 3), req(1, 2, 1)])
    a = res.steps.arrays()
    # step 1: both prefill (A 2 blocks, B 1); B's one token ends it. Steps 2, 3: A decodes alone.
    assert list(a["tokens"]) == [7, 1, 1]
    assert list(a["kv_live_tokens"]) == [7, 6, 7]
    assert list(a["kv_alloc_slots"]) == [12, 8, 8]  # 3 blocks of 4, then A's 2
    assert list(a["res_max_len"]) == [32, 16, 16]  # max_model_len 16 per resident sequence
    assert list(a["res_cap"]) == [13 + 10, 13, 13]  # prompt + a client cap of 8
    assert list(a["res_oracle"]) == [8 + 3, 8, 8]  # prompt + the exact output
    w = res.utilization()["kv_waste"]
    assert w["allocated"] == pytest.approx(8 / 28)  # (5 + 2 + 1) empty slots of 28, equal steps
    assert w["contiguous_max_len"] == pytest.approx(1 - 20 / 64)
    assert w["contiguous_prompt_plus_cap"] == pytest.approx(1 - 20 / 49)
    assert w["contiguous_oracle"] == pytest.approx(1 - 20 / 27)
    ra, rb = res.records
    assert (ra.ttft, ra.e2e, ra.chunk_times, ra.code) == (1.0, 3.0, [1.0, 2.0, 3.0], OK)
    assert (rb.ttft, rb.e2e, rb.completion_tokens) == (1.0, 1.0, 1)
    u = res.utilization()
    assert u["step_busy_fraction"] == pytest.approx(1.0)
    assert u["slot_occupancy"] == pytest.approx((2 + 1 + 1) / 3 / 4)
    assert u["useful_token_fraction"] == pytest.approx(1.0)


def test_static_padding_is_computed_and_counted_as_waste() -> None:
    res = Simulator(DEP, spec(mode=Batching.STATIC)).run([req(0, 5, 3), req(1, 2, 1)])
    a = res.steps.arrays()
    assert list(a["tokens"]) == [7, 2, 2]  # B keeps decoding as padding until A, the longest, ends
    assert list(a["padding"]) == [0, 1, 1]
    u = res.utilization()
    assert u["useful_token_fraction"] == pytest.approx(9 / 11)
    assert u["padding_slot_fraction"] == pytest.approx(2 / 6)
    assert res.records[1].e2e == 1.0  # its caller got the answer at once all the same


def test_a_contiguous_reservation_holds_the_whole_model_length_per_sequence() -> None:
    # One 16-token block of KV in all: B cannot start until A has finished and freed it.
    res = Simulator(DEP, spec(kv_layout="contiguous", num_blocks=1)).run([req(0, 5, 3), req(1, 2, 1)])
    assert res.block_size == 16
    ra, rb = res.records
    assert ra.e2e == 3.0
    assert rb.ttft == 4.0  # admitted at the 4th step, after A's 3
    assert res.utilization()["kv_waste"]["allocated"] == pytest.approx(1 - (5 + 6 + 7 + 2) / (4 * 16))


def test_arrivals_wait_for_the_step_in_flight_and_replicas_share_the_load() -> None:
    res = Simulator(DEP, spec()).run([req(0, 4, 2), req(1, 4, 2, at=0.5)])
    assert res.records[1].ttft == pytest.approx(1.5)  # joins the step starting at t=1
    two = Simulator(DEP, spec(), replicas=2).run([req(0, 4, 2), req(1, 4, 2, at=0.5)])
    assert two.records[1].ttft == pytest.approx(1.0)  # the idle replica starts it at once
    assert two.utilization()["step_busy_fraction"] == pytest.approx(4 / (2 * 2.5))


def test_a_horizon_leaves_the_rest_incomplete_and_infinitely_late() -> None:
    res = Simulator(DEP, spec(max_num_seqs=1)).run([req(0, 4, 10), req(1, 4, 1)], horizon_s=5.0)
    assert res.records[0].code == INCOMPLETE and res.records[0].completion_tokens == 5
    assert res.records[1].ttft == math.inf


def test_the_simulation_is_deterministic() -> None:
    reqs = [req(i, 3 + i % 5, 1 + i % 7, at=i * 0.3) for i in range(40)]
    one = Simulator(DEP, spec()).run(reqs)
    two = Simulator(DEP, spec()).run(reqs)
    assert [r.chunk_times for r in one.records] == [r.chunk_times for r in two.records]
    assert all(r.code == OK and r.completion_tokens == reqs[r.index].max_tokens for r in one.records)


def test_noisy_neighbour_on_the_virtual_clock_keeps_the_quiet_tenants_prefix_with_a_floor() -> None:
    # The noisy benchmark's runs at the small step budget: the flood evicts the quiet tenant's
    # system prompt between its requests unless the tenant has a KV floor.
    from loadtest import bench_noisy

    alone = bench_noisy.run_case(False, 0.0, 256)["quiet"]
    unprotected = bench_noisy.run_case(True, 0.0, 256)["quiet"]
    protected = bench_noisy.run_case(True, bench_noisy.FLOOR, 256)["quiet"]
    assert alone["prefix_hit_rate"] - unprotected["prefix_hit_rate"] > 0.2
    assert protected["prefix_hit_rate"] == alone["prefix_hit_rate"]
    assert protected["finished"] == alone["finished"] == alone["requests"]


def test_slo_admission_past_the_knee_keeps_admitted_interactive_requests_in_their_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slo benchmark's workload, shortened, at about 1.5x its knee: admitting everything, the
    # interactive queue outgrows its targets; the gateway's admission code refuses the requests
    # it predicts to miss, each with the reason, and the admitted ones keep their targets.
    from loadtest import bench_slo

    monkeypatch.setattr(bench_slo, "DURATION_S", 40.0)
    everything = bench_slo.summarize(bench_slo._run(64.0, admit=False))
    admitted = bench_slo.summarize(bench_slo._run(64.0, admit=True))
    assert everything["goodput_of_admitted"] < 0.5
    assert admitted["goodput_of_admitted"] >= 0.95
    assert 0 < admitted["chat_refused"] == admitted["refusals_with_reason"]
