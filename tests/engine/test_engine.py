"""Engine behaviour beyond greedy equality: sampling, stops, limits, aborts, validation."""

from __future__ import annotations

import pytest

from common import Priority
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, GenerationRequest, InvalidRequestError, SamplingParams
from worker.checkpoint import Checkpoint
from worker.detokenizer import IncrementalDetokenizer
from worker.engine import LLMEngine
from worker.step_trace import StepRow, StepTrace


@pytest.fixture
def tiny_engine(tiny: Checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(num_blocks=128, block_size=8, max_model_len=256), tiny)


@pytest.fixture(scope="module")
def smol_engine(smollm: Checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(num_blocks=128), smollm)


def _req(rid: str, ids: list[int], **sampling: object) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(**sampling))  # type: ignore[arg-type]


def test_same_seed_same_tokens_whatever_the_batch(tiny_engine: LLMEngine) -> None:
    prompt = tiny_engine.tokenizer.encode("once upon a time")
    params = dict(max_tokens=30, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny_engine.run_to_completion([_req("a", prompt, **params)])["a"].token_ids
    crowd = [
        _req(f"n{i}", tiny_engine.tokenizer.encode(f"noise {i}"), max_tokens=40, temperature=0.8)
        for i in range(5)
    ]
    together = tiny_engine.run_to_completion([*crowd, _req("b", prompt, **params)])["b"].token_ids
    other_seed = tiny_engine.run_to_completion([_req("c", prompt, **{**params, "seed": 99})])["c"].token_ids
    assert alone == together
    assert alone != other_seed


def test_top_k_one_is_greedy(tiny_engine: LLMEngine) -> None:
    prompt = tiny_engine.tokenizer.encode("the quick brown fox")
    greedy = tiny_engine.run_to_completion([_req("g", prompt, max_tokens=20, ignore_eos=True)])["g"]
    sampled = tiny_engine.run_to_completion(
        [_req("s", prompt, max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True)]
    )["s"]
    assert sampled.token_ids == greedy.token_ids


def test_tiny_top_p_is_greedy(tiny_engine: LLMEngine) -> None:
    prompt = tiny_engine.tokenizer.encode("jumps over")
    greedy = tiny_engine.run_to_completion([_req("g", prompt, max_tokens=20, ignore_eos=True)])["g"]
    sampled = tiny_engine.run_to_completion(
        [_req("s", prompt, max_tokens=20, temperature=1.0, top_p=1e-6, ignore_eos=True)]
    )["s"]
    assert sampled.token_ids == greedy.token_ids


def test_max_tokens_and_counts(tiny_engine: LLMEngine) -> None:
    prompt = tiny_engine.tokenizer.encode("count me")
    out = tiny_engine.run_to_completion([_req("m", prompt, max_tokens=7, ignore_eos=True)])["m"]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.completion_tokens == 7 == len(out.token_ids)
    assert out.prompt_tokens == len(prompt)


def test_stop_token_id_ends_generation(tiny_engine: LLMEngine) -> None:
    prompt = tiny_engine.tokenizer.encode("stop here")
    free = tiny_engine.run_to_completion([_req("f", prompt, max_tokens=12, ignore_eos=True)])["f"].token_ids
    stop_at = free[4]
    cut = tiny_engine.run_to_completion(
        [_req("c", prompt, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_at,))]
    )["c"]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.token_ids == free[: free.index(stop_at) + 1]


def test_context_limit_finishes_with_length(tiny_engine: LLMEngine) -> None:
    prompt = [65] * 250  # max_model_len is 256
    out = tiny_engine.run_to_completion([_req("l", prompt, max_tokens=100, ignore_eos=True)])["l"]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.completion_tokens == 6


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("prompt", lambda e: _req("x", [65] * 256)),
        ("prompt", lambda e: _req("x", [10**6])),
        ("prompt", lambda e: GenerationRequest("x", [])),
        ("max_tokens", lambda e: _req("x", [65], max_tokens=0)),
        ("temperature", lambda e: _req("x", [65], temperature=-1.0)),
        ("top_p", lambda e: _req("x", [65], top_p=0.0)),
        ("top_k", lambda e: _req("x", [65], top_k=-3)),
        ("temperature", lambda e: _req("x", [65], temperature=2.5)),  # the gateway's range, not wider
        ("stop[0]", lambda e: _req("x", [65], stop=("",))),
        ("stop", lambda e: _req("x", [65], stop=tuple("abcdefghijklmnopq"))),
        ("logprobs", lambda e: _req("x", [65], logprobs=21)),
    ],
)
def test_invalid_requests_name_their_field(tiny_engine: LLMEngine, field: str, make: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        tiny_engine.add_request(make(tiny_engine))  # type: ignore[operator]
    assert err.value.field == field
    assert not tiny_engine.has_unfinished()


def test_abort_frees_blocks_and_reports_tokens(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request(_req("a", [65] * 40, max_tokens=100, ignore_eos=True))
    tiny_engine.add_request(_req("b", [66] * 40, max_tokens=100, ignore_eos=True))
    produced = 0
    for _ in range(6):
        produced += sum(len(o.token_ids) for o in tiny_engine.step() if o.request_id == "a")
    assert tiny_engine.block_manager.num_used_blocks > 0
    final = tiny_engine.abort("a")
    assert final is not None and final.finish_reason is FinishReason.CANCELLED
    assert final.completion_tokens == produced > 0
    assert tiny_engine.abort("a") is None  # idempotent
    tiny_engine.abort("b")
    assert tiny_engine.block_manager.num_used_blocks == 0
    assert not tiny_engine.has_unfinished()


def test_stats_report_load(tiny_engine: LLMEngine) -> None:
    tiny_engine.add_request(
        GenerationRequest(
            "i", [65] * 20, SamplingParams(max_tokens=50, ignore_eos=True), priority=Priority.INTERACTIVE
        )
    )
    tiny_engine.add_request(
        GenerationRequest(
            "b", [65] * 20, SamplingParams(max_tokens=50, ignore_eos=True), priority=Priority.BATCH
        )
    )
    tiny_engine.step()
    s = tiny_engine.stats()
    assert s.running == {"interactive": 1, "standard": 0, "batch": 1}
    assert s.kv_blocks_used == 6 and s.kv_blocks_total == 128
    assert s.last_step_tokens == 40 and s.busy_fraction > 0
    # The counters utilization is computed from (docs/utilization.md).
    assert s.computed_tokens == 40 and s.recomputed_tokens == 0
    assert s.step_seconds > 0 and s.step_seq_seconds == pytest.approx(2 * s.step_seconds)
    kv_per_token = tiny_engine.kv_cache.bytes_per_token()
    assert s.step_bytes == tiny_engine.model.weight_bytes() + (40 + 40) * kv_per_token  # read + written
    tiny_engine.abort("i")
    tiny_engine.abort("b")


# ---- real tokenizer: text handling -------------------------------------------------------------


def test_detokenizer_never_splits_a_character(smollm: Checkpoint) -> None:
    tok = smollm.tokenizer
    text = "Naïve café: 🙂🚀 中文字符 and ünïcödé — done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d == "") > 0  # multi-token characters were held back


def test_stop_string_across_deltas_is_never_streamed(smollm: Checkpoint) -> None:
    tok = smollm.tokenizer
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=("ma del",))
    streamed = ""
    for i in ids:
        streamed += detok.add(i)
        if detok.stopped:
            break
    streamed += detok.flush()
    assert detok.stopped
    assert streamed == "alpha beta gam"


def test_stop_string_in_engine_output(smol_engine: LLMEngine) -> None:
    tok = smol_engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Count from one to ten in words."}])
    full = smol_engine.run_to_completion([_req("f", prompt, max_tokens=30)])["f"]
    words = full.text.split()
    assert len(words) > 4
    stop = words[3]
    cut = smol_engine.run_to_completion([_req("c", prompt, max_tokens=30, stop=(stop,))])["c"]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]
    assert smol_engine.block_manager.num_used_blocks == 0


def test_step_observers_see_every_step_as_scheduled(tiny_engine: LLMEngine) -> None:
    """The public step hook that benchmarks time by: one trace per step that ran, its rows as the
    scheduler planned them (before the step moved them on), its phases inside the step."""
    traces: list[StepTrace] = []
    stop = tiny_engine.add_step_observer(traces.append)
    steps_before = tiny_engine.stats().num_steps
    a, b = tiny_engine.tokenizer.encode("first prompt here"), tiny_engine.tokenizer.encode("second")
    tiny_engine.run_to_completion(
        [_req("a", a, max_tokens=3, ignore_eos=True), _req("b", b, max_tokens=3, ignore_eos=True)]
    )
    assert len(traces) == tiny_engine.stats().num_steps - steps_before == 3
    assert traces[0].rows == (StepRow(len(a), 0, True), StepRow(len(b), 0, True))  # both prefills
    assert traces[1].rows == (StepRow(1, len(a), True), StepRow(1, len(b), True))  # then decodes
    for t in traces:
        assert 0 < t.forward_s < t.step_s and 0 <= t.schedule_s < t.step_s
    stop()
    tiny_engine.run_to_completion([_req("c", a, max_tokens=2, ignore_eos=True)])
    assert len(traces) == 3  # removed: it sees no more steps
