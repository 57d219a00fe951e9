"""One request can never fail another: hostile sampling values and numerical faults stay in their row."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest
import torch

import worker.model_runner
from protocol.adapters import LoraRequest
from protocol.engine_config import EngineConfig
from protocol.requests import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from tests.helpers import eventually
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine
from worker.sampler import NON_FINITE, RequestRng, RowFailed
from worker.sampler import sample as real_sample

POISON_SEED = 424242  # marks the request whose logits the fault hits


@pytest.fixture
def engine(tiny: Checkpoint) -> LLMEngine:
    return LLMEngine(EngineConfig(num_blocks=128, block_size=8, max_model_len=256), tiny)


def _req(rid: str, text: str, tenant: str = "default", **sampling: Any) -> GenerationRequest:
    return GenerationRequest(rid, list(text.encode()), SamplingParams(**sampling), tenant=tenant)


def test_a_vanishing_temperature_samples_greedily(engine: LLMEngine) -> None:
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-4).greedy
    greedy = engine.run_to_completion([_req("g", "weave", max_tokens=16, ignore_eos=True)])["g"]
    tiny_t = engine.run_to_completion([_req("t", "weave", max_tokens=16, ignore_eos=True, temperature=1e-40)])
    assert tiny_t["t"].token_ids == greedy.token_ids
    assert tiny_t["t"].finish_reason is FinishReason.LENGTH


def test_non_finite_logits_fail_only_their_own_request(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    others = [_req(f"o{i}", f"tenant {i} text", max_tokens=24, ignore_eos=True) for i in range(3)]
    alone = engine.run_to_completion(others)
    calls = {"poisoned": 0}

    def faulty_sample(
        logits: torch.Tensor, params: list[SamplingParams], rngs: list[Any], *rest: Any
    ) -> list[Any]:
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.seed == POISON_SEED:
                logits[i, 3] = float("nan")
                calls["poisoned"] += 1
        return real_sample(logits, params, rngs, *rest)

    monkeypatch.setattr(worker.model_runner, "sample", faulty_sample)
    victim = _req("victim", "hostile", max_tokens=24, temperature=0.7, seed=POISON_SEED)
    again = [_req(f"o{i}", f"tenant {i} text", max_tokens=24, ignore_eos=True) for i in range(3)]
    together = engine.run_to_completion([*again[:2], victim, again[2]])

    assert calls["poisoned"] == 1
    assert together["victim"].finish_reason is FinishReason.ERROR
    assert "non-finite logits" in (together["victim"].error or "")
    for r in again:  # the rest of the batch went on, token for token as without the fault
        assert together[r.request_id].finish_reason is FinishReason.LENGTH
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_used_blocks == 0


def test_failing_forward_passes_are_counted_until_one_succeeds(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    real_forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", broken)
    for i in range(3):  # one tenant's requests failing, however often, are that tenant's failure
        out = engine.run_to_completion([_req(f"one{i}", "x", tenant="hostile", max_tokens=4)])
        assert out[f"one{i}"].finish_reason is FinishReason.ERROR
    assert engine.stats().consecutive_failed_steps == 0
    for i in range(3):  # a second tenant's fail as well: the replica's failure, every step counted
        out = engine.run_to_completion([_req(f"f{i}", "x", tenant=f"t{i}", max_tokens=4)])
        assert out[f"f{i}"].finish_reason is FinishReason.ERROR
    assert engine.stats().consecutive_failed_steps == 6
    monkeypatch.setattr(engine.model, "forward", real_forward)
    engine.run_to_completion([_req("ok", "x", max_tokens=4)])
    assert engine.stats().consecutive_failed_steps == 0


async def test_a_replica_whose_steps_keep_failing_reports_unhealthy(
    tiny: Checkpoint, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loadtest.tiny_model import save_hf_dir
    from serving.replica import EngineReplica
    from serving.replica_stats import UNHEALTHY_AFTER_FAILED_STEPS

    model_dir = save_hf_dir(tiny, tmp_path / "tiny")
    replica = EngineReplica(EngineConfig(model_path=str(model_dir), num_blocks=64), "shared")
    try:
        replica.check_health()
        core = replica.engine.engine

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("device lost")

        monkeypatch.setattr(core.model, "forward", broken)
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            outs = await _through_replica(replica, _req(f"r{i}", "x", tenant=f"t{i}", max_tokens=2))
            assert outs[-1].finish_reason is FinishReason.ERROR
            # The engine thread publishes its stats just after delivering the step's outputs.
            await eventually(lambda n=i + 1: replica.engine.stats().consecutive_failed_steps == (n > 1) * n)
            if i < UNHEALTHY_AFTER_FAILED_STEPS - 1:
                replica.check_health()  # a failure or two may be a request's fault
        with pytest.raises(Exception, match="forward passes failed"):
            replica.check_health()
    finally:
        replica.engine.shutdown()


def test_a_failing_step_is_split_to_find_its_culprit_and_the_others_go_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that raises because of one row (any cause the sampler cannot catch) is run again in
    halves until that row is found: it ends alone, every other row continues token for token as if
    nothing had happened, and the replica's health is untouched."""
    others = [
        _req(f"o{i}", f"tenant {i} text", tenant=f"t{i}", max_tokens=12, ignore_eos=True) for i in range(5)
    ]
    alone = engine.run_to_completion(others)
    real_forward = engine.model.forward
    poison = list(b"poison!")

    def fails_with_the_poison(fb: Any, *args: Any, **kwargs: Any) -> Any:
        if any(seq.request_id == "bad" for seq in fails_with_the_poison.seqs):
            raise RuntimeError("a kernel assertion")
        return real_forward(fb, *args, **kwargs)

    fails_with_the_poison.seqs = []  # type: ignore[attr-defined]
    real_execute = engine.runner.execute

    def execute(batch: Any) -> Any:
        fails_with_the_poison.seqs = batch.seqs  # type: ignore[attr-defined]
        return real_execute(batch)

    monkeypatch.setattr(engine.model, "forward", fails_with_the_poison)
    monkeypatch.setattr(engine.runner, "execute", execute)
    again = [
        _req(f"o{i}", f"tenant {i} text", tenant=f"t{i}", max_tokens=12, ignore_eos=True) for i in range(5)
    ]
    hostile = GenerationRequest("bad", poison, SamplingParams(max_tokens=12), tenant="hostile")
    together = engine.run_to_completion([*again[:3], hostile, *again[3:]])
    assert together["bad"].finish_reason is FinishReason.ERROR
    assert "a kernel assertion" in (together["bad"].error or "")
    for r in again:
        assert together[r.request_id].finish_reason is FinishReason.LENGTH
        assert together[r.request_id].token_ids == alone[r.request_id].token_ids
    assert engine.stats().consecutive_failed_steps == 0
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_used_blocks == 0


def test_greedy_rows_take_the_first_maximum_and_skip_non_finite_rows() -> None:
    """Greedy picks the lowest index among tied maxima (as argmax does) in a batch mixing greedy,
    sampled and non-finite rows; only the non-finite row gets no token."""
    logits = torch.zeros(4, 300)
    logits[0, [7, 200]] = 5.0  # tied: 7
    logits[1, 40] = 9.0  # sampled row
    logits[2, [250, 3]] = 2.0  # tied: 3
    logits[3, 11] = float("nan")
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(), SamplingParams()]
    rngs: list[Any] = [None, RequestRng(1), None, None]
    got = real_sample(logits, params, rngs)
    assert got[0] == 7 and got[2] == 3 and got[3] == NON_FINITE and isinstance(got[1], int)
    all_greedy = real_sample(logits[[0, 2]], [SamplingParams(), SamplingParams()], [None, None])
    assert all_greedy == [7, 3]


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-8, 0.5])
def test_any_top_p_keeps_the_most_probable_token(top_p: float) -> None:
    """A JSON top_p of 1e-46 is 0.0 in float32: it masked every token and raised in the step of
    every co-batched request. The most probable token always stays, so a tiny top_p is greedy."""
    logits = torch.randn(3, 500)
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=top_p, seed=3), SamplingParams()]
    got = real_sample(logits, params, [None, RequestRng(3), None])
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())
    assert isinstance(got[1], int)
    if top_p < 1e-6:
        assert got[1] == int(logits[1].argmax())


def test_a_row_whose_sampling_raises_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever raises while sampling one row (a value no check foresaw) costs only that row."""
    import worker.sampler

    real_one = worker.sampler._sample_one

    def fragile(logits: torch.Tensor, params: SamplingParams, rng: RequestRng, position: int) -> int:
        if params.seed == POISON_SEED:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return real_one(logits, params, rng, position)

    monkeypatch.setattr(worker.sampler, "_sample_one", fragile)
    logits = torch.randn(3, 200)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.8, seed=POISON_SEED),
        SamplingParams(),
    ]
    got = real_sample(logits, params, [RequestRng(1), RequestRng(POISON_SEED), None])
    assert isinstance(got[0], int) and got[2] == int(logits[2].argmax())
    assert got[1] == RowFailed("sampling failed for this request (RuntimeError)")


def test_a_request_whose_sampling_raises_ends_alone_and_the_batch_goes_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.sampler

    real_one = worker.sampler._sample_one

    def fragile(logits: torch.Tensor, params: SamplingParams, rng: RequestRng, position: int) -> int:
        if params.seed == POISON_SEED:
            raise ValueError("no token to draw")
        return real_one(logits, params, rng, position)

    others = [_req(f"o{i}", f"tenant {i} text", max_tokens=12, ignore_eos=True) for i in range(2)]
    alone = engine.run_to_completion(others)
    monkeypatch.setattr(worker.sampler, "_sample_one", fragile)
    victim = _req("victim", "hostile", max_tokens=12, temperature=0.7, seed=POISON_SEED)
    again = [_req(f"o{i}", f"tenant {i} text", max_tokens=12, ignore_eos=True) for i in range(2)]
    together = engine.run_to_completion([again[0], victim, again[1]])
    assert together["victim"].finish_reason is FinishReason.ERROR
    assert (
        together["victim"].error
        == "sampling failed for this request (ValueError); it was stopped (others were not)"
    )
    for i in range(2):
        assert together[f"o{i}"].token_ids == alone[f"o{i}"].token_ids
        assert together[f"o{i}"].finish_reason is FinishReason.LENGTH
    assert engine.stats().consecutive_failed_steps == 0


def _broken_adapter(tmp_path: Any) -> LoraRequest:
    """An adapter whose weights file is garbage: its load fails, so the gate fails its requests."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    return LoraRequest("t/broken", str(broken))


def _until_loaded(engine: LLMEngine, adapter: LoraRequest) -> None:
    assert engine.lora is not None
    load = engine.lora._loads[adapter.id]
    concurrent.futures.wait([load])


def test_every_ended_request_counts_once_as_finished(
    tiny: Checkpoint, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate rejection, a non-finite row and a normal end each count one finished request."""
    engine = LLMEngine(EngineConfig(num_blocks=128, block_size=8, max_model_len=256, max_loras=1), tiny)

    def faulty_sample(
        logits: torch.Tensor, params: list[SamplingParams], rngs: list[Any], *rest: Any
    ) -> list[Any]:
        logits = logits.clone()
        for i, p in enumerate(params):
            if p.seed == POISON_SEED:
                logits[i, 3] = float("nan")
        return real_sample(logits, params, rngs, *rest)

    monkeypatch.setattr(worker.model_runner, "sample", faulty_sample)
    rejected = GenerationRequest(
        "bad", list(b"x"), SamplingParams(max_tokens=4), adapter=_broken_adapter(tmp_path)
    )
    poisoned = _req("nan", "hostile", max_tokens=8, temperature=0.7, seed=POISON_SEED)
    normal = _req("ok", "fine", max_tokens=8, ignore_eos=True)
    out = engine.run_to_completion([rejected, poisoned, normal])
    assert [out[r].finish_reason for r in ("bad", "nan", "ok")] == [
        FinishReason.ERROR,
        FinishReason.ERROR,
        FinishReason.LENGTH,
    ]
    assert engine.stats().finished_requests == 3


def test_a_step_whose_forward_fails_still_ends_the_requests_the_gate_rejected(
    tiny: Checkpoint, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows the gate failed earlier in a step get their final output even when the forward raises."""
    engine = LLMEngine(EngineConfig(num_blocks=128, block_size=8, max_model_len=256, max_loras=1), tiny)
    adapter = _broken_adapter(tmp_path)
    engine.add_request(_req("ok", "fine", max_tokens=8, ignore_eos=True))
    engine.add_request(GenerationRequest("bad", list(b"x"), SamplingParams(max_tokens=4), adapter=adapter))
    engine.step()  # "ok" prefills; "bad" waits while its adapter is read (and fails to load)
    _until_loaded(engine, adapter)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model, "forward", broken)
    ended = {o.request_id: o for o in engine.step() if o.finished}
    assert set(ended) == {"bad", "ok"}
    assert "adapter could not be loaded" in (ended["bad"].error or "")
    assert "device lost" in (ended["ok"].error or "")
    assert not engine.has_unfinished()
    assert engine.stats().finished_requests == 2
    engine.block_manager.check_consistency()
    assert engine.block_manager.num_used_blocks == 0


async def _through_replica(replica: Any, request: GenerationRequest) -> list[RequestOutput]:
    """One request as a gateway sends it: the call, its deltas on the subscriber's stream."""
    from serving.pinning import Pinned

    stream = replica.deltas(Pinned(replica.replica_id, "test-gateway"))
    assert await anext(stream) == []  # the stream is open
    call = asyncio.ensure_future(replica.generate([request], "test-gateway"))
    outs: list[RequestOutput] = []
    while not (outs and outs[-1].finished):
        outs += await asyncio.wait_for(anext(stream), 30)
    await call
    await stream.aclose()
    return outs
