"""Constrained decoding in the engine (tiny random model, byte tokenizer): every constrained output
matches, unconstrained rows beside constrained ones are unchanged, log-probabilities stay the
model's, and preemption, resumed streams, n copies, stop strings and LoRA adapters keep the grammar's
place. A grammar that fails (too costly, or one that cannot be built) fails its own request only."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.token_mask import (
    apply_token_bitmask_,
    apply_token_bitmask_ref_,
    masked_argmax,
    masked_argmax_ref,
)
from loadtest.tiny_model import save_random_adapter
from protocol import structured
from protocol.adapters import LoraRequest
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, GenerationRequest, InvalidRequestError, SamplingParams
from protocol.structured import Constraint, ConstraintKind
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine
from worker.scheduler import Gate

REGEX = Constraint(ConstraintKind.REGEX, r"[a-f]{2,5}( [0-9]{1,3}){1,3}")
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"enum": ["x", "yy"]}},
    "required": ["n", "s"],
    "additionalProperties": False,
}
JSON = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


def _engine(tiny: Checkpoint, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"num_blocks": 128, "block_size": 8, "max_model_len": 256, **kw}), tiny)


def _req(engine: LLMEngine, rid: str, text: str, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(rid, engine.tokenizer.encode(text), SamplingParams(**sampling))


@pytest.fixture(scope="module")
def engine(tiny: Checkpoint) -> LLMEngine:
    return _engine(tiny)


def test_constrained_outputs_match_and_unconstrained_rows_are_unchanged(engine: LLMEngine) -> None:
    plain = [_req(engine, f"u{i}", f"free text {i}", max_tokens=20, ignore_eos=True) for i in range(2)]
    alone = engine.run_to_completion(plain)
    constrained = [
        _req(engine, "re-greedy", "pattern", max_tokens=40, constraint=REGEX),
        _req(engine, "re-sampled", "pattern", max_tokens=40, constraint=REGEX, temperature=1.0, seed=1),
        _req(engine, "js-greedy", "object", max_tokens=40, constraint=JSON),
        _req(engine, "js-sampled", "object", max_tokens=40, constraint=JSON, temperature=1.5, seed=2),
        _req(
            engine,
            "choice",
            "pick",
            max_tokens=40,
            constraint=Constraint(ConstraintKind.CHOICE, choices=("no", "yes!")),
        ),
    ]
    plain = [_req(engine, f"u{i}", f"free text {i}", max_tokens=20, ignore_eos=True) for i in range(2)]
    together = engine.run_to_completion([plain[0], *constrained, plain[1]])
    for r in plain:  # beside constrained rows, an unconstrained greedy row is token for token the same
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids
    for rid in ("re-greedy", "re-sampled"):
        assert together[rid].finish_reason is FinishReason.STOP
        assert re.fullmatch(REGEX.spec, together[rid].text), together[rid].text
    for rid in ("js-greedy", "js-sampled"):
        assert together[rid].finish_reason is FinishReason.STOP
        value = json.loads(together[rid].text)
        assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and value["s"] in ("x", "yy")
    assert together["choice"].text in ("no", "yes!")
    engine.block_manager.check_consistency()


def test_a_constrained_greedy_run_is_reproducible_and_seeded_runs_too(engine: LLMEngine) -> None:
    def run() -> dict[str, Any]:
        return engine.run_to_completion(
            [
                _req(engine, "g", "again", max_tokens=40, constraint=JSON),
                _req(engine, "s", "again", max_tokens=40, constraint=JSON, temperature=1.0, seed=7),
            ]
        )

    a, b = run(), run()
    assert a["g"].token_ids == b["g"].token_ids and a["s"].token_ids == b["s"].token_ids


def test_logprobs_are_the_models_own_not_the_masks(engine: LLMEngine) -> None:
    """The first token's log-probabilities under a constraint equal the unconstrained run's: the mask
    picks the token, it does not rewrite the distribution reported."""
    choice = Constraint(ConstraintKind.CHOICE, choices=("zq",))
    free = engine.run_to_completion(
        [_req(engine, "f", "same prompt", max_tokens=1, logprobs=5, temperature=1.0, seed=3)]
    )
    forced = engine.run_to_completion(
        [
            _req(
                engine,
                "c",
                "same prompt",
                max_tokens=3,
                logprobs=5,
                temperature=1.0,
                seed=3,
                constraint=choice,
            )
        ]
    )
    assert forced["c"].text == "zq"
    lp_free, lp_forced = free["f"].logprobs[0], forced["c"].logprobs[0]  # type: ignore[index]
    assert lp_forced.top == lp_free.top  # the model's five best, most of which the grammar forbids
    z = engine.tokenizer.encode("z", add_special_tokens=False)[0]
    assert lp_forced.token_id == z and lp_forced.logprob < 0


def test_preempted_constrained_requests_recompute_and_keep_their_grammar(tiny: Checkpoint) -> None:
    def reqs(engine: LLMEngine) -> list[GenerationRequest]:
        return [
            _req(engine, f"r{i}", f"tight {i} " * 3, max_tokens=40, constraint=JSON if i % 2 else REGEX)
            for i in range(6)
        ]

    roomy = _engine(tiny)
    want = roomy.run_to_completion(reqs(roomy))
    tight = _engine(tiny, num_blocks=14)  # six sequences of up to ~60 tokens in 112 slots: preemption
    got = tight.run_to_completion(reqs(tight))
    assert tight.scheduler.num_preemptions > 0
    for rid, out in want.items():
        assert got[rid].token_ids == out.token_ids
    tight.block_manager.check_consistency()


def test_a_resumed_stream_continues_its_grammar_where_it_was_cut(engine: LLMEngine) -> None:
    whole = engine.run_to_completion([_req(engine, "w", "resume me", max_tokens=40, constraint=JSON)])["w"]
    assert whole.finish_reason is FinishReason.STOP and len(whole.token_ids) > 6
    prompt = engine.tokenizer.encode("resume me")
    for cut in (1, 3, len(whole.token_ids) - 2):
        delivered = whole.token_ids[:cut]
        resumed = GenerationRequest(
            f"r{cut}",
            prompt + delivered,
            SamplingParams(max_tokens=40 - cut, constraint=JSON),
            num_resumed_tokens=cut,
        )
        rest = engine.run_to_completion([resumed])[f"r{cut}"]
        assert delivered + rest.token_ids == whole.token_ids


def test_stop_strings_and_copies_of_one_prompt(engine: LLMEngine) -> None:
    stopped = engine.run_to_completion(
        [
            _req(
                engine,
                "s",
                "x",
                max_tokens=40,
                constraint=Constraint(ConstraintKind.REGEX, "ab+c"),
                stop=("bb",),
            )
        ]
    )["s"]
    assert stopped.finish_reason is FinishReason.STOP and stopped.text in ("a", "ab")  # cut before "bb"
    copies = engine.run_to_completion(
        [
            _req(engine, f"n{i}", "same", max_tokens=40, constraint=JSON, temperature=1.0, seed=i)
            for i in range(4)
        ]
    )
    for out in copies.values():  # each copy has its own matcher
        assert json.loads(out.text)["s"] in ("x", "yy")


def test_a_grammar_that_cannot_be_built_fails_its_request_alone(engine: LLMEngine) -> None:
    broken = Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule")
    not_json = Constraint(ConstraintKind.JSON_SCHEMA, "{oops")
    plain = _req(engine, "ok", "bystander", max_tokens=12, ignore_eos=True)
    alone = engine.run_to_completion([plain])["ok"]
    plain = _req(engine, "ok", "bystander", max_tokens=12, ignore_eos=True)
    out = engine.run_to_completion(
        [_req(engine, "b1", "x", constraint=broken), plain, _req(engine, "b2", "x", constraint=not_json)]
    )
    assert out["ok"].token_ids == alone.token_ids
    for rid in ("b1", "b2"):
        assert out[rid].finish_reason is FinishReason.ERROR and "constraint" in (out[rid].error or "")
        assert out[rid].request_fault  # its own: not to be retried elsewhere
    with pytest.raises(InvalidRequestError, match="longer than"):
        engine.add_request(
            _req(engine, "big", "x", constraint=Constraint(ConstraintKind.REGEX, "a" * 70_000))
        )


def test_a_grammar_past_its_step_fuel_fails_alone_beside_a_greedy_stream(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pathological grammar (an ambiguous one whose Earley items grow with every token) beside a
    tenant's greedy stream: the stream is unchanged, the costly row ends with an error once a mask
    would need more than its step's fuel, and no step fails. The fuel is lowered here so that the tiny
    model's short outputs reach it; the production limit bounds a mask to a few milliseconds."""
    monkeypatch.setattr(
        structured, "LIMITS", dataclasses.replace(structured.LIMITS, grammar_step_max_items=300)
    )
    engine = _engine(tiny)
    plain = _req(engine, "victim", "victim text", max_tokens=40, ignore_eos=True)
    alone = engine.run_to_completion([plain])["victim"]
    # At least 25 "a"s before the closing "c", each after any number of ambiguous "a"/"b" runs.
    costly = Constraint(ConstraintKind.GRAMMAR, 'start: x~25 "c"\nx: s "a"\ns: s s s | s s | "a" | "b" | ""')
    hostile = [
        _req(engine, f"h{i}", "x", max_tokens=40, constraint=costly, temperature=1.0, seed=i)
        for i in range(4)
    ]
    out = engine.run_to_completion(
        [*hostile, _req(engine, "victim", "victim text", max_tokens=40, ignore_eos=True)]
    )
    assert out["victim"].token_ids == alone.token_ids
    failed = [o for rid, o in out.items() if rid != "victim" and o.finish_reason is FinishReason.ERROR]
    assert failed, {rid: (o.finish_reason, o.text) for rid, o in out.items()}
    assert len(failed) == 4 and all("Too many items" in (o.error or "") and o.request_fault for o in failed)
    assert not out["victim"].request_fault
    assert engine.counters.consecutive_failed_steps == 0
    engine.block_manager.check_consistency()


def test_the_grammar_waits_at_the_gate_off_the_engine_thread(engine: LLMEngine) -> None:
    """A sequence whose grammar is being built waits (the engine thread never builds one); once built,
    a later request of the same tenant and constraint starts at once from the kept grammar."""
    fresh = Constraint(ConstraintKind.REGEX, "[0-9]{7}")
    req = _req(engine, "g1", "gate", max_tokens=10, constraint=fresh)
    engine.add_request(req)
    seq = engine.scheduler.get("g1")
    assert seq is not None
    first = engine.grammars.admit(seq)
    assert first in (Gate.WAIT, Gate.READY)
    out = engine.drain()["g1"]
    assert re.fullmatch("[0-9]{7}", out.text)
    engine.add_request(_req(engine, "g2", "gate", max_tokens=10, constraint=fresh))
    again = engine.scheduler.get("g2")
    assert again is not None and engine.grammars.admit(again) is Gate.READY  # kept: no wait
    engine.drain()


def test_an_adapter_and_a_constraint_together(tiny: Checkpoint, tmp_path: Path) -> None:
    engine = _engine(tiny, max_loras=1)
    path = save_random_adapter(tiny.config, tmp_path / "a", seed=3)
    req = _req(engine, "l", "adapted", max_tokens=40, constraint=JSON)
    req.adapter = LoraRequest("t/a", str(path))
    out = engine.run_to_completion([req])["l"]
    assert out.finish_reason is FinishReason.STOP and json.loads(out.text)["s"] in ("x", "yy")
    assert engine.lora is not None and engine.lora.running() == ()  # its slot was given back


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_mask_kernels_match_their_torch_references(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    vocab = 1000  # not a multiple of 32: the last word is partial
    logits = torch.randn(24, vocab, generator=g)
    logits[3, 10] = float("-inf")
    which = torch.randperm(24, generator=g)[:rows]
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask &= torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask[0] = 0  # a row that allows nothing
    ids, found = masked_argmax(logits, which, bitmask)
    ref_ids, ref_found = masked_argmax_ref(logits, which, bitmask)
    assert torch.equal(found, ref_found) and torch.equal(ids[found], ref_ids[ref_found])
    got, want = torch.full_like(logits, float("nan")), torch.full_like(logits, float("nan"))
    got.copy_(logits)
    want.copy_(logits)
    assert torch.equal(
        apply_token_bitmask_(got, which, bitmask), apply_token_bitmask_ref_(want, which, bitmask)
    )
    assert torch.equal(got, want)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[which] = False
    assert torch.equal(got[untouched], logits[untouched])  # unconstrained rows are not written


def test_a_bounded_number_ends_after_its_tenth_fraction_digit() -> None:
    """Under "maximum": 1 only zeros may follow "1."; without a cap on fraction digits a model that
    wanted another digit writes zeros until max_tokens. The cap ends the number; the client's schema
    (and a value inside const) is untouched, and an unbounded number keeps its exponent."""
    from llguidance import LLMatcher

    from protocol.model_files import load_tokenizer

    tokenizer = load_tokenizer()
    llt = structured.grammar_tokenizer(tokenizer)
    bounded = {"type": ["number", "null"], "minimum": 0, "maximum": 1}
    schema = {
        "type": "object",
        "properties": {
            "p": bounded,
            "q": {"type": "number"},
            "c": {"const": {"type": "number", "maximum": 1}},
        },
    }
    spec = json.dumps(schema)

    def parses(text: str) -> bool:
        matcher = LLMatcher(llt, structured.grammar_text(Constraint(ConstraintKind.JSON_SCHEMA, spec)))
        return bool(matcher.consume_tokens(tokenizer.encode(text))) and matcher.is_accepting()

    zeros = "1." + "0" * structured.JSON_NUMBER_FRACTION_DIGITS
    assert parses(f'{{"p": {zeros}}}') and parses('{"p": 0.25}')
    assert not parses(f'{{"p": {zeros}0}}')
    assert not parses('{"p": 0.' + "3" * (structured.JSON_NUMBER_FRACTION_DIGITS + 1) + "}")
    assert parses('{"q": 6.02e23}') and parses('{"q": 0.' + "3" * 20 + "}")
    assert parses('{"c": {"type": "number", "maximum": 1}}')
    assert json.loads(spec) == schema
