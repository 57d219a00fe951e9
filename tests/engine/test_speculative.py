"""Speculative decoding: proposals verified in the batch change how fast tokens come, never which.

Greedy output equals decoding a token a step (and so transformers'); sampled output keeps its
distribution and its seed; stops, limits, logprobs, preemption and the prefix cache behave as
without speculation; a row whose proposals fail stops proposing where proposals cost."""

from __future__ import annotations

import pytest
import torch

from common import Priority
from loadtest.tiny_model import random_checkpoint, tiny_config
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from tests.engine.conftest import MAX_TOKENS
from worker.block_manager import BlockManager
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine
from worker.proposer import NgramProposer
from worker.rejection_sampler import verify
from worker.sampler import RequestRng, probabilities
from worker.scheduler import Scheduler, SchedulerConfig
from worker.sequence import Sequence, SequenceStatus
from worker.speculation import Speculation, StepCost

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "members agreed to fund the children's reading room, extend opening hours on weekends, and hire two "
    "additional librarians."
)


def _seq(tokens: list[int], rid: str = "s", **sampling: object) -> Sequence:
    return Sequence.from_request(
        GenerationRequest(rid, tokens, SamplingParams(**sampling), speculative=True)  # type: ignore[arg-type]
    )


def _decoding(seq: Sequence) -> Sequence:
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, seq.num_tokens - 1
    return seq


class _MemoryBoundStep(StepCost):
    """A step that costs 25 ms plus 0.1 ms a token, whatever this machine measures meanwhile: what
    the tests count (steps) must not move with the load beside them."""

    def __init__(self) -> None:
        super().__init__(base=0.025, per_token=0.0001)

    def record(self, tokens: int, seconds: float) -> None:
        return None


def _memory_bound(engine: LLMEngine) -> LLMEngine:
    engine.speculation.cost = _MemoryBoundStep()
    return engine


def _run(engine: LLMEngine, reqs: list[GenerationRequest]) -> dict[str, RequestOutput]:
    out = engine.run_to_completion(reqs)
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_used_blocks == 0 or engine.config.enable_prefix_caching
    assert not engine.has_unfinished()
    return out


def _repeat_prompt(ck: Checkpoint) -> list[int]:
    return ck.tokenizer.encode_chat([{"role": "user", "content": f"Repeat exactly:\n\n{TEXT}"}])


def _req(rid: str, ids: list[int], spec: bool, **sampling: object) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**sampling), speculative=spec)  # type: ignore[arg-type]


# ---- the proposer ----------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    seq = _seq([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # Suffix [1, 2, 3] occurred at the start (followed by 4, 5); [2, 3] also later (followed by 7).
    assert p.guess(seq, 4) == [4, 5, 9, 2]
    assert p.guess(seq, 12) == [4, 5, 9, 2, 3, 7, 8, 1, 2, 3, 4, 5]  # past the end: around the loop
    assert p.guess(seq, 1) == [4]
    seq.token_ids += [7]  # suffix [2, 3, 7]: only after position 6
    assert p.guess(seq, 3) == [8, 1, 2]
    seq.token_ids += [6, 6]  # [7, 6, 6], [6, 6]: never seen before
    assert p.guess(seq, 3) == []
    assert p.guess(_seq([5, 5]), 3) == []  # too short to have a suffix and an earlier match


def test_a_proposal_never_runs_past_max_tokens_or_the_context() -> None:
    spec = Speculation(NgramProposer(), max_tokens=8, max_model_len=20)
    seq = _decoding(_seq([1, 2, 3] * 5, max_tokens=100))  # 15 tokens: room for 4 and the bonus
    assert spec.propose([seq])[seq] == [1, 2, 3, 1]
    short = _seq([1, 2, 3, 1, 2], max_tokens=3)
    short.token_ids += [3]  # one output token: room for one more and the bonus
    _decoding(short)
    assert spec.propose([short])[short] == [1]


def test_rows_that_did_not_opt_in_or_are_constrained_propose_nothing() -> None:
    spec = Speculation(NgramProposer(), max_tokens=4, max_model_len=100)
    plain = _decoding(Sequence.from_request(GenerationRequest("p", [1, 2, 1, 2], SamplingParams())))
    assert spec.propose([plain]) == {}


# ---- the price of a proposal -----------------------------------------------------------------


def test_step_cost_is_fitted_from_the_engines_steps() -> None:
    cost = StepCost(base=1.0, per_token=1.0)
    for tokens in [1, 8, 40, 3, 64, 16] * 10:
        cost.record(tokens, 0.02 + 0.002 * tokens)
    assert abs(cost.base - 0.02) < 1e-6 and abs(cost.per_token - 0.002) < 1e-7


class _WrongGuesses:
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        return [[0] * n for n in room]


def test_a_row_whose_guesses_fail_stops_proposing_in_a_large_batch_not_alone() -> None:
    spec = Speculation(_WrongGuesses(), max_tokens=4, max_model_len=1000)
    spec.cost = StepCost(base=0.025, per_token=0.001)  # a CPU's step: 25 ms plus 1 ms a token
    batch = [_decoding(_seq([1, 2, 3], rid=f"r{i}", max_tokens=100)) for i in range(32)]
    first = spec.propose(batch)
    assert first and sum(map(len, first.values())) < 4 * 32  # priced: not every token is worth it
    for _ in range(10):
        for seq, guess in spec.propose(batch).items():
            spec.record(seq, len(guess), 0)
    assert spec.propose(batch) == {}  # 32 rows of failing guesses: every proposal costs more than it yields
    alone = batch[:1]
    assert len(spec.propose(alone)[alone[0]]) >= 1  # alone, a step barely notices a few more tokens
    counts = spec.counts["default"]
    assert counts.accepted_tokens == 0 and counts.draft_tokens >= counts.drafts > 0


# ---- scheduling ------------------------------------------------------------------------------


def _scheduler(num_blocks: int, budget: int = 64) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, block_size=4)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), bm), bm


def _prefilled(sched: Scheduler, *prompts: list[int]) -> list[Sequence]:
    """Sequences of ``prompts`` with their prompts computed and a first token (9) sampled."""
    seqs = [_seq(p, rid=f"r{i}", max_tokens=50) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_output_tokens == 0 for s in seqs):
        batch = sched.schedule()
        ends = [
            s
            for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            if s.num_computed_tokens + n == s.num_tokens
        ]
        sched.update_from_output(batch, dict.fromkeys(ends, 9))
    return seqs


def test_proposals_count_against_the_budget_and_are_charged_as_decode() -> None:
    sched, _ = _scheduler(64, budget=3)
    [seq] = _prefilled(sched, list(range(1, 7)))
    before = sched.fair.service["default"]
    batch = sched.schedule({seq: [1, 2, 3, 4]})
    assert batch.num_tokens == [3] and batch.spec[seq] == [1, 2]
    assert sched.fair.service["default"] - before == 2 * 3


def test_rejected_proposals_give_their_blocks_back() -> None:
    sched, bm = _scheduler(64)
    [seq] = _prefilled(sched, [1, 2, 3, 4, 5, 6])  # 7 tokens: two blocks of 4
    batch = sched.schedule({seq: [1, 2, 3, 4, 5, 6]})  # up to position 12: four blocks
    assert len(seq.block_table) == 4
    [update] = sched.update_from_output(batch, {seq: 8}, {seq: [1]})
    assert update.tokens == (1, 8) and seq.num_tokens == 9 and seq.num_computed_tokens == 8
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    bm.check_consistency()


def test_a_row_drops_its_proposals_before_anyone_is_preempted_for_them() -> None:
    sched, bm = _scheduler(4)  # 16 token slots
    a, b = _prefilled(sched, list(range(1, 8)), list(range(1, 8)))  # 8 tokens each: 2 blocks each
    batch = sched.schedule({a: [1, 2, 3], b: [1, 2, 3]})
    assert batch.spec == {} and batch.num_tokens == [1, 1] and not batch.preempted
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 0


def test_a_stop_token_among_accepted_proposals_ends_the_row_there() -> None:
    sched, bm = _scheduler(64)
    [seq] = _prefilled(sched, [1, 2, 3, 4, 5, 6])
    seq.stop_token_ids = frozenset({2})
    batch = sched.schedule({seq: [1, 2, 3]})
    [update] = sched.update_from_output(batch, {seq: 4}, {seq: [1, 2, 3]})
    assert update.tokens == (1, 2) and update.finish_reason is FinishReason.STOP
    assert seq.output_token_ids == [9, 1, 2] and bm.num_used_blocks == 0


# ---- verification ----------------------------------------------------------------------------


def test_sampled_verification_keeps_the_distribution() -> None:
    """Speculative sampling with a one-point draft: the first token is distributed as p, whatever
    is proposed (a likely token, an unlikely one), and so is the token after an accepted one."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5, seed=1)
    p0, p1 = probabilities(logits[0], params), probabilities(logits[1], params)
    picks = logits.argmax(-1).tolist()
    n = 30_000
    for proposal in ([int(p0.argmax()), int(p1.argmax())], [int(p0.argmin()), 0]):
        first = torch.zeros(6)
        second = torch.zeros(6)
        for trial in range(n):
            out = verify(logits, picks, True, proposal, params, RequestRng(trial), position=40)
            first[out[0]] += 1
            if out[0] == proposal[0]:
                second[out[1]] += 1
        assert (first / n - p0).abs().sum() < 0.03, (first / n, p0)
        if second.sum() > 2000:
            assert (second / second.sum() - p1).abs().sum() < 0.06, (second / second.sum(), p1)


def test_greedy_verification_is_the_argmax_prefix_then_the_models_token() -> None:
    logits = torch.zeros(4, 5)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 1.0
    picks = [3, 1, 4, 2]
    params = SamplingParams()
    assert verify(logits, picks, True, [3, 1, 4], params, None) == [3, 1, 4, 2]
    assert verify(logits, picks, True, [3, 0, 4], params, None) == [3, 1]
    assert verify(logits, picks, True, [2, 1, 4], params, None) == [3]
    assert not isinstance(verify(logits, picks, False, [3], params, None), list)  # non-finite: failed


# ---- the engine ------------------------------------------------------------------------------


def test_greedy_with_speculation_equals_transformers(
    smollm: Checkpoint, prompt_ids: list[list[int]], hf_reference: list[list[int]]
) -> None:
    engine = LLMEngine(EngineConfig(num_blocks=256), smollm)
    reqs = [_req(f"r{i}", ids, True, max_tokens=MAX_TOKENS) for i, ids in enumerate(prompt_ids)]
    out = _run(engine, reqs)
    assert [out[f"r{i}"].token_ids for i in range(len(prompt_ids))] == hf_reference
    assert engine.stats().speculation["default"].draft_tokens > 0  # it did speculate


def test_grounded_work_accepts_most_proposals_and_changes_nothing(smollm: Checkpoint) -> None:
    ids = _repeat_prompt(smollm)
    plain = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, False, max_tokens=40)])
    engine = _memory_bound(LLMEngine(EngineConfig(num_blocks=256), smollm))
    spec = _run(engine, [_req("r", ids, True, max_tokens=40)])
    assert spec["r"].token_ids == plain["r"].token_ids and spec["r"].text == plain["r"].text
    assert spec["r"].completion_tokens == 40
    counts = engine.stats().speculation["default"]
    assert counts.accepted_tokens >= 0.8 * counts.draft_tokens > 0
    assert engine.counters.steps < 30  # 40 tokens (and the prompt) in far fewer steps


def test_stop_strings_limits_and_logprobs_are_as_without_speculation(smollm: Checkpoint) -> None:
    ids = _repeat_prompt(smollm)
    cases = [
        {"max_tokens": 30, "stop": ("reading",)},  # a stop string inside an accepted run
        {"max_tokens": 7},  # the limit inside one
        {"max_tokens": 12, "logprobs": 2},
    ]
    for sampling in cases:
        plain = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, False, **sampling)])
        spec = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, True, **sampling)])
        a, b = plain["r"], spec["r"]
        assert (b.token_ids, b.text, b.finish_reason, b.completion_tokens) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.completion_tokens,
        ), sampling
        if "stop" in sampling:
            assert a.finish_reason is FinishReason.STOP and "reading" not in a.text
        if a.logprobs is not None:
            assert b.logprobs is not None and len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_a_seed_gives_the_same_sampled_text_with_speculation_or_without(smollm: Checkpoint) -> None:
    """A position's draw depends on the seed and the position only, and a proposal holds when it
    equals that draw: how many tokens a step verified (which depends on the machine's timing
    through the price of proposals) never changes the text."""
    ids = _repeat_prompt(smollm)
    sampling = {"max_tokens": 24, "temperature": 0.7, "seed": 11}
    plain = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, False, **sampling)])["r"]
    engine = _memory_bound(LLMEngine(EngineConfig(num_blocks=256), smollm))
    spec = _run(engine, [_req("r", ids, True, **sampling)])["r"]
    assert spec.token_ids == plain.token_ids
    assert engine.stats().speculation["default"].accepted_tokens > 0
    other = _run(
        LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, True, **{**sampling, "seed": 12})]
    )["r"]
    assert other.token_ids != plain.token_ids  # the seed does matter


def test_preemption_and_the_prefix_cache_with_speculation(tiny: Checkpoint) -> None:
    """Too few blocks for every row: rows are preempted and recomputed (from the prefix cache where
    it still holds them), and every row's greedy tokens equal those of a run without speculation
    and without pressure."""
    prompts = [[3 + i, 4, 5, 6] * 6 for i in range(6)]

    def run(spec: bool, num_blocks: int) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=128), tiny)
        reqs = [
            GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True), speculative=spec)
            for i, p in enumerate(prompts)
        ]
        out = _run(engine, reqs)
        return [out[f"r{i}"].token_ids for i in range(len(prompts))], engine

    reference, _ = run(False, 256)
    tight, engine = run(True, 40)
    assert tight == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats().speculation["default"].accepted_tokens > 0


def test_speculation_is_per_request(smollm: Checkpoint) -> None:
    ids = _repeat_prompt(smollm)
    engine = LLMEngine(EngineConfig(num_blocks=256), smollm)
    _run(
        engine,
        [
            GenerationRequest("a", ids, SamplingParams(max_tokens=16), tenant="a", speculative=True),
            GenerationRequest("b", ids, SamplingParams(max_tokens=16), tenant="b", priority=Priority.BATCH),
        ],
    )
    counts = engine.stats().speculation
    assert counts["a"].drafts > 0 and "b" not in counts


# ---- a draft model ---------------------------------------------------------------------------


def _draft_run(
    target: Checkpoint, draft: Checkpoint | None, num_blocks: int = 256
) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=160)
    engine = _memory_bound(LLMEngine(config, target, draft=draft))
    prompts = [[3 + i, 40, 41, 42, 43] * 3 for i in range(5)]
    reqs = [
        GenerationRequest(
            f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True), speculative=draft is not None
        )
        for i, p in enumerate(prompts)
    ]
    out = _run(engine, reqs)
    return [out[f"r{i}"].token_ids for i in range(len(prompts))], engine


def test_a_draft_of_the_same_weights_is_always_right(tiny: Checkpoint) -> None:
    reference, _ = _draft_run(tiny, None)
    tokens, engine = _draft_run(tiny, tiny)
    assert tokens == reference
    counts = engine.stats().speculation["default"]
    assert counts.draft_tokens > 0 and counts.accepted_tokens >= 0.9 * counts.draft_tokens
    assert engine.counters.steps < 20  # 30 tokens each in far fewer steps than 30


def test_a_different_draft_changes_only_the_speed(tiny: Checkpoint) -> None:
    other = random_checkpoint(tiny_config(num_layers=1, hidden_size=32, intermediate_size=64), seed=5)
    reference, _ = _draft_run(tiny, None)
    tokens, engine = _draft_run(tiny, other, num_blocks=48)  # tight: preemptions, and rows stopping
    assert tokens == reference
    assert engine.stats().speculation["default"].draft_tokens > 0
    proposer = engine.speculation.proposer
    engine.speculation.propose([])  # the rows that ended give their draft blocks back
    assert proposer.num_free_blocks == engine.block_manager.num_blocks  # type: ignore[attr-defined]


def test_a_draft_of_another_vocabulary_is_refused(smollm: Checkpoint, tiny: Checkpoint) -> None:
    with pytest.raises(ValueError, match="speculative_draft_model: its vocabulary has"):
        LLMEngine(EngineConfig(num_blocks=64), smollm, draft=tiny)


def test_a_resumed_stream_continues_exactly_with_speculation(smollm: Checkpoint) -> None:
    """A stream cut after 9 tokens and resumed elsewhere (its delivered tokens appended to the
    prompt) ends with the same tokens and text as the uncut one."""
    ids = _repeat_prompt(smollm)
    whole = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [_req("r", ids, True, max_tokens=24)])["r"]
    cut = 9
    resumed = GenerationRequest(
        "r2",
        ids + whole.token_ids[:cut],
        SamplingParams(max_tokens=24 - cut),
        num_resumed_tokens=cut,
        speculative=True,
    )
    rest = _run(LLMEngine(EngineConfig(num_blocks=256), smollm), [resumed])["r2"]
    assert rest.token_ids == whole.token_ids[cut:]
    head = smollm.tokenizer.decode(whole.token_ids[:cut])
    assert whole.text.startswith(head) and head + rest.text == whole.text
