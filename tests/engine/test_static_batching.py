"""Static batching, the benchmarks' baseline, as the scheduler subclass they bring
(loadtest/static_batching.py): cohorts that are never backfilled, padding that keeps computing until
the cohort ends, and the engine loading it by ``EngineConfig.scheduler_cls``."""

from __future__ import annotations

import pydantic
import pytest

from loadtest.scheduler_sim import SchedulerSim
from loadtest.static_batching import Batching, StaticBatchingScheduler
from protocol.engine_config import EngineConfig
from protocol.requests import GenerationRequest, SamplingParams
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine
from worker.scheduler import Scheduler, scheduler_class


def _assert_clean(sim: SchedulerSim) -> None:
    sim.bm.check_consistency()
    assert sim.bm.num_used_blocks == 0
    assert not sim.scheduler.has_work() and not sim.scheduler.running
    assert all(r.finished_step is not None for r in sim.requests.values()), "a request was dropped"


@pytest.mark.parametrize("mode", [Batching.STATIC, Batching.STATIC_NO_PADDING])
def test_static_modes_never_backfill(mode: Batching) -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, mode=mode, num_blocks=512)
    short = [sim.submit(4, 2) for _ in range(3)]
    long = sim.submit(4, 30)
    later = [sim.submit(4, 2) for _ in range(4)]
    sim.run()
    end_of_cohort = sim.requests[long].finished_step
    assert all(sim.requests[s].finished_step < end_of_cohort for s in short)
    assert all(sim.requests[r].first_scheduled_step > end_of_cohort for r in later)
    _assert_clean(sim)


def test_static_mode_keeps_finished_members_as_padding_until_the_cohort_ends() -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, mode=Batching.STATIC, num_blocks=512)
    short = sim.submit(4, 2)
    long = sim.submit(4, 30)
    sizes = []
    while sim.scheduler.has_work():
        sizes.append(len(sim.step().seqs))
    assert sim.requests[short].finished_step < sim.requests[long].finished_step
    assert sizes == [2] * len(sizes), "a finished member left its cohort before the cohort ended"
    assert sim.requests[short].seq.num_tokens > 4 + 2  # it ran on as padding
    _assert_clean(sim)


def test_static_padding_is_released_by_an_abort_of_the_last_member() -> None:
    sim = SchedulerSim(max_num_seqs=4, mode=Batching.STATIC, num_blocks=512)
    sim.submit(4, 2)
    long = sim.submit(4, 300)
    for _ in range(10):
        sim.step()
    sim.abort(long)
    assert sim.bm.num_used_blocks == 0
    assert not sim.scheduler.running
    sim.bm.check_consistency()


def test_padding_is_counted_and_gives_no_output() -> None:
    sim = SchedulerSim(max_num_seqs=4, max_num_batched_tokens=64, mode=Batching.STATIC, num_blocks=512)
    short = sim.submit(4, 2)
    sim.submit(4, 10)
    outputs: dict[str, int] = {}
    while sim.scheduler.has_work():
        batch = sim.scheduler.schedule()
        sampled = {
            s: 7
            for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            if s.num_computed_tokens + n == s.num_tokens
        }
        for u in sim.scheduler.update_from_output(batch, sampled):
            outputs[u.seq.request_id] = outputs.get(u.seq.request_id, 0) + 1
    sched = sim.scheduler
    assert isinstance(sched, StaticBatchingScheduler)
    assert outputs[short] == 2  # its padding steps reached no one
    assert sched.padding_tokens == 10 - 2  # one decode token per step until the long member ended
    assert not sched.held


def test_continuous_mode_runs_the_product_scheduler() -> None:
    assert Batching.CONTINUOUS.scheduler_cls is None and scheduler_class(None) is Scheduler
    for mode in (Batching.STATIC, Batching.STATIC_NO_PADDING):
        assert scheduler_class(mode.scheduler_cls) is mode.scheduler


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("loadtest.no_such_module:X", "cannot be loaded"),
        ("loadtest.static_batching:NoSuchClass", "cannot be loaded"),
        ("loadtest.static_batching:Batching", "not a subclass"),
    ],
)
def test_a_scheduler_cls_that_is_not_a_scheduler_is_refused(path: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        scheduler_class(path)


def test_a_malformed_scheduler_cls_is_refused_by_the_config() -> None:
    with pytest.raises(pydantic.ValidationError, match="scheduler_cls"):
        EngineConfig(scheduler_cls="not a path")


@pytest.mark.parametrize("mode", [Batching.STATIC, Batching.STATIC_NO_PADDING])
def test_static_modes_give_the_same_greedy_tokens(tiny: Checkpoint, mode: Batching) -> None:
    prompts = [[65 + i] * (5 + 3 * i) for i in range(6)]
    lengths = [3, 20, 7, 1, 12, 5]

    def run(batching: Batching) -> dict[str, list[int]]:
        config = EngineConfig(
            num_blocks=128, block_size=8, max_num_seqs=4, scheduler_cls=batching.scheduler_cls
        )
        engine = LLMEngine(config, tiny)
        assert type(engine.scheduler) is batching.scheduler
        pairs = enumerate(zip(prompts, lengths, strict=True))
        reqs = [
            GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in pairs
        ]
        outs = engine.run_to_completion(reqs)
        assert engine.block_manager.num_used_blocks == 0
        assert not engine.scheduler.running
        assert engine.stats().finished_requests == len(reqs)
        return {k: o.token_ids for k, o in outs.items()}

    static = run(mode)
    assert static == run(Batching.CONTINUOUS)
    assert [len(static[f"r{i}"]) for i in range(6)] == lengths
