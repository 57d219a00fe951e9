"""Scheduler behaviour on the real scheduler and block manager (stand-in model, see scheduler_sim)."""

from __future__ import annotations

from common import Priority
from loadtest.scheduler_sim import SchedulerSim


def _assert_clean(sim: SchedulerSim) -> None:
    sim.bm.check_consistency()
    assert sim.bm.num_used_blocks == 0
    assert not sim.scheduler.has_work()
    assert all(r.finished_step is not None for r in sim.requests.values()), "a request was dropped"


def test_weighted_fair_share_under_saturation() -> None:
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=1024)
    for _ in range(60):
        sim.submit(16, 40, tenant="a", weight=1.0)
        sim.submit(16, 40, tenant="b", weight=3.0)
    for _ in range(400):  # both tenants stay backlogged throughout
        sim.step()
    assert sim.scheduler.num_waiting() > 0
    tokens = sim.scheduler.fair.tokens
    ratio = tokens["b"] / tokens["a"]
    assert abs(ratio - 3.0) / 3.0 < 0.10, f"b/a token ratio {ratio:.2f}, want 3 within 10%"


def test_equal_weights_share_equally_whatever_the_arrival_order() -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=32, num_blocks=1024)
    for _ in range(40):  # tenant a floods first; b arrives after
        sim.submit(8, 30, tenant="a")
    for _ in range(40):
        sim.submit(8, 30, tenant="b")
    for _ in range(300):
        sim.step()
    tokens = sim.scheduler.fair.tokens
    assert abs(tokens["a"] / tokens["b"] - 1.0) < 0.10


def test_interactive_ttft_unaffected_by_batch_backlog() -> None:
    def ttft(with_backlog: bool) -> int:
        sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=512)
        if with_backlog:
            for _ in range(100):
                sim.submit(40, 200, tenant="bulk", priority=Priority.BATCH)
            for _ in range(20):
                sim.step()
            assert sim.scheduler.num_running(Priority.BATCH) == 8
        rid = sim.submit(100, 5, tenant="chat", priority=Priority.INTERACTIVE)
        start = sim.step_no
        while sim.requests[rid].first_token_step is None:
            sim.step()
        return sim.requests[rid].first_token_step - start

    alone = ttft(False)
    assert alone == 1  # 100 prompt tokens in 64-token chunks: two steps
    assert ttft(True) == alone


def test_priority_classes_off_serves_interactive_behind_the_batch_backlog() -> None:
    # The baseline of the served priority benchmark: with classes off, an interactive arrival queues
    # behind the batch work that came first, where with classes on it is served at once.
    def ttft(classes: bool) -> int:
        sim = SchedulerSim(
            max_num_seqs=4, max_num_batched_tokens=64, num_blocks=512, priority_classes=classes
        )
        for _ in range(12):
            sim.submit(8, 20, tenant="bulk", priority=Priority.BATCH)
        sim.step()
        rid = sim.submit(8, 3, tenant="chat", priority=Priority.INTERACTIVE)
        start = sim.step_no
        while sim.requests[rid].first_token_step is None:
            sim.step()
        sim.run()
        _assert_clean(sim)
        return sim.requests[rid].first_token_step - start

    assert ttft(True) == 0
    assert ttft(False) == 19  # behind the four running batch requests: their 19 remaining tokens


def test_interactive_arrival_preempts_batch_when_slots_are_full() -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=512)
    bulk = [sim.submit(8, 100, tenant="bulk", priority=Priority.BATCH) for _ in range(4)]
    sim.step()
    chat = sim.submit(8, 3, tenant="chat", priority=Priority.INTERACTIVE)
    batch = sim.step()
    assert sim.requests[chat].seq in batch.seqs
    assert len(batch.preempted) == 1 and batch.preempted[0].request_id in bulk
    sim.run()
    _assert_clean(sim)


def test_chunked_prefill_never_stalls_decodes() -> None:
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=512)
    decoders = [sim.submit(4, 60) for _ in range(3)]
    for _ in range(3):
        sim.step()
    long_prompt = sim.submit(300, 4)
    chunks = []
    while sim.requests[long_prompt].first_token_step is None:
        batch = sim.step()
        sizes = dict(zip((s.request_id for s in batch.seqs), batch.num_tokens, strict=True))
        assert all(sizes.get(d) == 1 for d in decoders), "a decode stalled behind the long prompt"
        assert batch.total_tokens <= 32
        chunks.append(sizes[long_prompt])
    assert sum(chunks) == 300 and max(chunks) == 29 and len(chunks) > 5
    sim.run()
    _assert_clean(sim)


def test_a_tenants_prompts_in_flight_never_hold_back_another_tenants_new_request() -> None:
    # The flooder's running prefill chunks could fill every step's budget for 60 steps; the other
    # tenant, less served, gets its prompt into the very next step.
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=1024)
    for _ in range(4):
        sim.submit(1000, 4, tenant="flood")
    for _ in range(3):
        batch = sim.step()
        assert batch.total_tokens == 64
    rid = sim.submit(8, 4, tenant="quiet")
    start = sim.step_no
    sim.step()
    assert sim.requests[rid].first_token_step == start
    sim.run()
    _assert_clean(sim)


def test_out_of_blocks_preempts_lowest_priority_most_over_share() -> None:
    # 12 blocks of 4 tokens; three sequences each needing up to 8 blocks cannot all fit.
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=12, block_size=4)
    hi = sim.submit(8, 24, tenant="x", priority=Priority.INTERACTIVE)
    lo_a = sim.submit(8, 24, tenant="y", priority=Priority.BATCH)
    lo_b = sim.submit(8, 24, tenant="z", priority=Priority.BATCH)
    preempted: list[str] = []
    while sim.scheduler.has_work():
        preempted += [s.request_id for s in sim.step().preempted]
    assert preempted, "capacity never ran out: the test lost its point"
    assert hi not in preempted
    assert set(preempted) <= {lo_a, lo_b}
    # the interactive request was never held back: it finished first
    assert sim.requests[hi].finished_step < min(
        sim.requests[lo_a].finished_step, sim.requests[lo_b].finished_step
    )
    _assert_clean(sim)


def test_preempted_request_resumes_and_finishes_with_all_tokens() -> None:
    sim = SchedulerSim(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=10, block_size=4)
    rids = [sim.submit(6, 20, tenant=f"t{i}") for i in range(4)]
    sim.run()
    assert sim.scheduler.num_preemptions > 0
    for rid in rids:
        seq = sim.requests[rid].seq
        assert seq.num_output_tokens == 20
    _assert_clean(sim)


def test_abort_frees_blocks_immediately() -> None:
    sim = SchedulerSim(max_num_seqs=8, num_blocks=64, block_size=4)
    a = sim.submit(10, 50)
    b = sim.submit(10, 50)
    for _ in range(5):
        sim.step()
    used = sim.bm.num_used_blocks
    sim.abort(a)
    assert sim.bm.num_used_blocks < used
    sim.abort(b)
    assert sim.bm.num_used_blocks == 0
    sim.bm.check_consistency()


def test_continuous_mode_backfills_freed_slots() -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=512)
    [sim.submit(4, 2) for _ in range(3)]
    long = sim.submit(4, 30)
    later = [sim.submit(4, 2) for _ in range(4)]
    sim.run()
    assert all(sim.requests[r].finished_step < sim.requests[long].finished_step for r in later)
    _assert_clean(sim)


def test_prefix_cache_reuses_blocks_and_evicts_lru() -> None:
    sim = SchedulerSim(num_blocks=16, block_size=4)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks cacheable
    first = sim.submit(0, 2, prompt=prompt)
    sim.run()
    again = sim.submit(0, 2, prompt=prompt)
    sim.run()
    assert sim.requests[first].seq.num_cached_prompt_tokens == 0
    assert sim.requests[again].seq.num_cached_prompt_tokens == 20
    # Unrelated prompts needing every block evict the cached ones; nothing stays pinned.
    sim.submit(0, 2, prompt=list(range(500, 560)))
    sim.run()
    third = sim.submit(0, 2, prompt=prompt)
    sim.run()
    assert sim.requests[third].seq.num_cached_prompt_tokens < 20
    _assert_clean(sim)
