"""Fair share measured as the VTC paper states it, on the real scheduler (stand-in model): backlogged
tenants with mixed prompt and output lengths, weights 1:1, 1:3 and 1:1:3:3. Service counts prefill
tokens at 1 and decode tokens at 2, measured from each step's batch (loadtest/fairness.py)."""

from __future__ import annotations

import pytest

from common import Priority
from loadtest.fairness import Fairness, Shapes, backlogged_run, pool_run, service
from loadtest.scheduler_sim import SchedulerSim
from serving.pool_ledger import PoolLedger
from worker.fair_share import FairShare, ServiceCosts

SEQS, BUDGET = 16, 256  # slot-bound: the batch is full of decodes while the budget idles
DEFAULT_SEQS, DEFAULT_BUDGET = 64, 512  # the engine's defaults
LONG_PROMPTS = ((8, 512), (4, 64))  # (prompt length range, output length range)
LONG_OUTPUTS = ((8, 64), (16, 256))
WINDOW = 200  # steps: 10 s at 50 ms a step


def _run(
    weights: dict[str, float],
    shapes: dict[str, Shapes],
    costs: ServiceCosts | None = None,
    seqs: int = SEQS,
    budget: int = BUDGET,
) -> Fairness:
    return backlogged_run(weights, shapes, costs, max_num_seqs=seqs, step_budget=budget, window=WINDOW)


@pytest.mark.parametrize(
    ("weights", "shapes"),
    [
        ({"a": 1.0, "b": 1.0}, {"a": LONG_PROMPTS, "b": LONG_OUTPUTS}),
        ({"a": 1.0, "b": 3.0}, {"a": LONG_PROMPTS, "b": LONG_OUTPUTS}),
        ({"a": 1.0, "b": 1.0, "c": 3.0, "d": 3.0}, {t: ((8, 512), (4, 256)) for t in "abcd"}),
    ],
)
def test_weighted_service_difference_is_bounded_and_windows_are_even(
    weights: dict[str, float], shapes: dict[str, Shapes]
) -> None:
    f = _run(weights, shapes, seqs=DEFAULT_SEQS, budget=DEFAULT_BUDGET)
    assert f.max_difference <= f.bound, f
    # On average within one U of the short-term term (the longest prompt or a step's decodes).
    assert f.mean_difference <= max(512, 2 * DEFAULT_BUDGET), f
    assert f.jain_min >= 0.99 and f.jain_min_half >= 0.99, f
    # Slot-bound, a tenant that falls behind waits for a slot to free: the windows are less even.
    slot_bound = _run(weights, shapes)
    assert slot_bound.max_difference <= slot_bound.bound, slot_bound
    assert slot_bound.mean_difference <= max(512, 2 * BUDGET), slot_bound
    assert slot_bound.jain_min >= 0.98 and slot_bound.jain_mean >= 0.99, slot_bound


def test_counting_tokens_alike_lets_decode_heavy_tenants_drift() -> None:
    """The accounting the test above relies on: charged at one cost per token, whatever the phase, a
    tenant of long outputs gets ever more service than one of long prompts (the difference grows
    with time instead of staying bounded)."""
    shapes = {"a": LONG_PROMPTS, "b": LONG_OUTPUTS}
    fair = _run({"a": 1.0, "b": 1.0}, shapes)
    alike = _run({"a": 1.0, "b": 1.0}, shapes, ServiceCosts(prefill=1.0, decode=1.0))
    assert alike.mean_difference > 10 * fair.mean_difference
    assert alike.jain_min < 0.95 <= fair.jain_min


def test_service_is_charged_per_phase_once_per_position() -> None:
    """Prefill at 1 and decode at 2 per computed position; prefix-cache hits and the recompute after a
    preemption are free."""
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=256, block_size=4)
    prompt = list(range(1000, 1100))
    sim.submit(100, 10, tenant="a", prompt=prompt)
    sim.run()
    # 100 prompt positions, then 9 decode positions (the last token sampled is never computed).
    assert sim.scheduler.fair.service["a"] == 100 + 2 * 9
    sim.submit(100, 10, tenant="a", prompt=prompt)  # the same prompt: 96 tokens from the cache
    sim.run()
    assert sim.scheduler.fair.service["a"] == 2 * (100 + 2 * 9) - 96

    def charged(num_blocks: int) -> tuple[float, int]:
        tight = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=num_blocks, block_size=4)
        for _ in range(4):
            tight.submit(20, 30, tenant="b")
        tight.run()
        return tight.scheduler.fair.service["b"], tight.scheduler.num_preemptions

    roomy, none = charged(256)
    squeezed, preemptions = charged(32)  # four sequences of up to 50 tokens in 128 slots
    assert none == 0 and preemptions > 0
    assert squeezed == roomy == 4 * (20 + 2 * 29)


def test_service_on_other_replicas_counts_toward_a_tenants_share() -> None:
    fair = FairShare()
    std = Priority.STANDARD
    fair.activate(std, "a")
    fair.activate(std, "b")
    fair.charge(std, "a", 1.0, prefill=10, decode=0)
    assert fair.counter(std, "a") > fair.counter(std, "b")
    fair.set_remote({(std, "b"): 100.0})  # b was served elsewhere in the pool
    assert fair.counter(std, "b") > fair.counter(std, "a")
    assert fair.served() == {(std, "a"): 10.0}  # what this replica reports: its own service only
    fair.activate(std, "c")  # a newcomer is lifted to the least counter, remote service included
    assert fair.counter(std, "c") == fair.counter(std, "a")


def test_the_pool_ledger_gives_each_replica_the_others_service() -> None:
    std, batch = Priority.STANDARD, Priority.BATCH
    ledger = PoolLedger()
    assert ledger.report("r0", {(std, "a"): 5.0}) == {}
    assert ledger.report("r1", {(std, "a"): 2.0, (batch, "b"): 1.0}) == {(std, "a"): 5.0}
    assert ledger.report("r0", {(std, "a"): 7.0}) == {(std, "a"): 2.0, (batch, "b"): 1.0}
    assert ledger.report("r1", {(std, "a"): 3.0}) == {(std, "a"): 7.0}  # cumulative: replaced


def test_a_tenant_pinned_to_one_replica_gets_its_share_of_the_pool() -> None:
    """Tenant b's requests all go to replica 0 (an affinity), a's to both: alone, each replica is fair
    to its own and b gets a quarter of the pool; sharing service through the ledger, half."""
    shapes = dict.fromkeys("ab", ((8, 512), (4, 256)))
    weights = {"a": 1.0, "b": 1.0}
    alone, alone_shares = pool_run(weights, shapes, {"b": 0}, ledger_every=None)
    pooled, shares = pool_run(weights, shapes, {"b": 0}, ledger_every=20)
    assert alone_shares["b"] < 0.3 and alone.jain_mean < 0.85
    assert shares["b"] > 0.45 and pooled.jain_mean >= 0.99


def test_service_given_while_a_tenant_was_alone_is_not_owed_back_after_an_idle_spell() -> None:
    """Light runs alone, everything ends, then heavy comes back first and light after it: both
    backlogged from there, they split the service 1:3 (light's earlier service, while nobody else
    wanted any, is not a debt that starves it)."""
    sim = SchedulerSim(max_num_seqs=16, max_num_batched_tokens=256, num_blocks=4096, block_size=16)
    for _ in range(60):
        sim.submit(64, 64, tenant="light", weight=1.0)
    sim.run()
    start = len(sim.served)
    for _ in range(400):
        sim.submit(64, 64, tenant="heavy", weight=3.0)
    for _ in range(400):
        sim.submit(64, 64, tenant="light", weight=1.0)
    for _ in range(600):
        sim.step()
    got = {t: sum(service(s, t, 1.0, 2.0) for s in sim.served[start:]) for t in ("light", "heavy")}
    assert 2.7 < got["heavy"] / got["light"] < 3.3, got
