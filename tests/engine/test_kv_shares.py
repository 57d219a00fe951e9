"""Per-tenant KV shares (floor and cap, prefix-cache residency included) and the aging of preempted
work, on the real scheduler and block manager (stand-in model, see scheduler_sim).

Each test runs its scenario with the protection and without it, and asserts that the difference is
there: a test that passed without the protection would prove nothing.
"""

from __future__ import annotations

import pytest

from loadtest.scheduler_sim import SchedulerSim
from protocol.requests import InvalidRequestError, KvShare

SYSTEM = list(range(500, 532))  # a 32-token system prompt: 8 blocks of 4


def _quiet_hit_after_flood(floor: float) -> int:
    """Prompt tokens the quiet tenant finds cached when it comes back after a flood."""
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4)
    share = KvShare(floor=floor)
    sim.submit(0, 4, tenant="quiet", prompt=[*SYSTEM, 1, 2, 3], kv_share=share)
    sim.run()
    for _ in range(12):  # 12 x 20 blocks through a 64-block pool: LRU alone evicts everything
        sim.submit(60, 20, tenant="flood")
    sim.run()
    back = sim.submit(0, 4, tenant="quiet", prompt=[*SYSTEM, 4, 5, 6], kv_share=share)
    sim.run()
    sim.bm.check_consistency()
    assert all(r.finished_step is not None for r in sim.requests.values())
    return sim.requests[back].seq.num_cached_prompt_tokens


def test_floor_keeps_an_idle_tenants_prefix_cache_through_a_flood() -> None:
    assert _quiet_hit_after_flood(floor=0.0) == 0, "the flood did not evict: the test lost its point"
    assert _quiet_hit_after_flood(floor=0.25) == len(SYSTEM)


def _preemptions_of_long_request(floor: float) -> int:
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4)
    long = sim.submit(8, 100, tenant="quiet", weight=1.0, kv_share=KvShare(floor=floor))
    for _ in range(24):
        sim.submit(8, 40, tenant="busy", weight=4.0)
    sim.run()
    sim.bm.check_consistency()
    assert all(r.finished_step is not None for r in sim.requests.values())
    assert sim.requests[long].seq.num_output_tokens == 100
    return sim.requests[long].seq.num_preemptions


def test_floor_keeps_a_tenants_sequences_from_preemption_by_others() -> None:
    # The quiet tenant's one long request holds more than its weighted share (1 of 5): without a
    # floor it is the one preempted when the busy tenant's sequences grow.
    assert _preemptions_of_long_request(floor=0.0) > 0
    assert _preemptions_of_long_request(floor=0.5) == 0


def _admission_wait(floor: float) -> int:
    """Steps the quiet tenant's request waits while the busy tenant's long requests fill every slot."""
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64, block_size=4)
    for _ in range(12):
        sim.submit(8, 100, tenant="busy")
    sim.step()
    rid = sim.submit(12, 4, tenant="quiet", kv_share=KvShare(floor=floor))
    start = sim.step_no
    sim.run()
    sim.bm.check_consistency()
    assert all(r.finished_step is not None for r in sim.requests.values())
    return sim.requests[rid].first_scheduled_step - start


def test_tenant_under_its_floor_preempts_a_tenant_over_its_own_to_get_in() -> None:
    assert _admission_wait(floor=0.0) > 50
    assert _admission_wait(floor=0.25) == 0


def _max_held_while_several_run(cap: float) -> tuple[int, int]:
    """(most blocks the capped tenant held while running two or more sequences, steps until the
    other tenant's requests all started)."""
    sim = SchedulerSim(max_num_seqs=16, max_num_batched_tokens=128, num_blocks=64, block_size=4)
    for _ in range(20):
        sim.submit(16, 16, tenant="capped", kv_share=KvShare(cap=cap))
    sim.step()
    other = [sim.submit(16, 16, tenant="other") for _ in range(4)]
    most = 0
    while sim.scheduler.has_work():
        sim.step()
        if sim.scheduler.num_running() and sum(1 for s in sim.scheduler.running if s.tenant == "capped") > 1:
            most = max(most, sim.bm.held("capped"))
    sim.bm.check_consistency()
    assert all(r.finished_step is not None for r in sim.requests.values())
    return most, max(sim.requests[r].first_scheduled_step for r in other)


def test_cap_bounds_what_a_tenant_holds_its_cached_prefixes_included() -> None:
    uncapped, _ = _max_held_while_several_run(cap=1.0)
    assert uncapped > 16, "the tenant never held more than the cap: the test lost its point"
    capped, others_started = _max_held_while_several_run(cap=0.25)
    assert capped <= 16  # 0.25 of 64 blocks, cached prefixes counted
    assert others_started <= 2


def test_cap_never_stops_a_tenants_only_request() -> None:
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4)
    rid = sim.submit(60, 20, tenant="capped", kv_share=KvShare(cap=0.1))  # 20 blocks against a cap of 6
    sim.run(max_steps=500)
    assert sim.requests[rid].finished_step is not None
    assert sim.requests[rid].seq.num_output_tokens == 20


def test_floors_promising_more_than_the_pool_are_scaled_down() -> None:
    sim = SchedulerSim(num_blocks=100)
    for t in ("a", "b", "c", "d"):
        sim.submit(4, 1, tenant=t, kv_share=KvShare(floor=0.5))
    assert [sim.bm.shares.floor(t) for t in "abcd"] == [25, 25, 25, 25]


@pytest.mark.parametrize(
    ("floor", "cap", "field"),
    [(-0.1, 1.0, "kv_share.floor"), (1.5, 1.0, "kv_share.floor"), (0.0, 0.0, "kv_share.cap"),
     (0.0, 1.01, "kv_share.cap"), (0.6, 0.5, "kv_share"), (float("nan"), 1.0, "kv_share.floor"),
     (0.0, float("inf"), "kv_share.cap")],
)  # fmt: skip
def test_kv_share_out_of_range_is_refused_naming_the_field(floor: float, cap: float, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        KvShare(floor=floor, cap=cap)
    assert err.value.field == field


def _long_requests_under_a_flood(limit: int | None) -> tuple[int, int]:
    """(most preemptions of one of two long requests, most steps any request took from submission
    to its end) while short requests arrive every third step."""
    sim = SchedulerSim(
        max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4, preemption_limit=limit
    )
    longs = [sim.submit(16, 180, tenant="long") for _ in range(2)]
    for i in range(1500):
        if i % 3 == 0 and i < 600:
            sim.submit(8, 16, tenant="flood")
        sim.step()
    sim.bm.check_consistency()
    assert not sim.scheduler.has_work(), "the load is not an overload: everything must end"
    most_preempted = max(sim.requests[r].seq.num_preemptions for r in longs)
    longest = max(r.finished_step - r.submitted_step for r in sim.requests.values())
    return most_preempted, longest


def test_aging_bounds_how_often_a_request_is_preempted_and_how_long_it_waits() -> None:
    unaged_preemptions, unaged_longest = _long_requests_under_a_flood(limit=None)
    assert unaged_preemptions > 10  # the long request keeps losing its blocks to the flood
    preemptions, longest = _long_requests_under_a_flood(limit=3)
    # At most the limit, and once more when the two long requests cannot both fit the pool and
    # the younger yields to the older.
    assert preemptions <= 3 + 1
    assert longest < 300 < unaged_longest
