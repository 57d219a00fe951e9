"""The asyncio engine API: concurrent streams, cancellation, validation, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from protocol.engine_config import EngineConfig
from protocol.requests import (
    EngineDeadError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
)
from tests.helpers import eventually
from worker.async_engine import AsyncEngine
from worker.checkpoint import Checkpoint
from worker.engine import LLMEngine


@pytest.fixture
def engine(tiny: Checkpoint):
    eng = AsyncEngine(LLMEngine(EngineConfig(num_blocks=128, block_size=8, max_model_len=256), tiny)).start()
    yield eng
    eng.shutdown()


def _req(rid: str, n: int = 20, prompt: str = "hello") -> GenerationRequest:
    return GenerationRequest(rid, list(prompt.encode()), SamplingParams(max_tokens=n, ignore_eos=True))


async def _collect(engine: AsyncEngine, req: GenerationRequest) -> tuple[list[int], str, FinishReason | None]:
    ids: list[int] = []
    text = ""
    reason = None
    async for out in engine.generate(req):
        ids += out.token_ids
        text += out.text
        reason = out.finish_reason
    return ids, text, reason


async def _until_idle(engine: AsyncEngine) -> None:
    await eventually(lambda: engine.stats().kv_blocks_used == 0 and not engine.engine.has_unfinished())


async def test_concurrent_streams_match_offline(engine: AsyncEngine, tiny: Checkpoint) -> None:
    offline = LLMEngine(EngineConfig(num_blocks=128, block_size=8), tiny)
    expected = offline.run_to_completion([_req(f"r{i}", 12 + i, f"prompt {i}") for i in range(4)])
    results = await asyncio.gather(
        *(_collect(engine, _req(f"r{i}", 12 + i, f"prompt {i}")) for i in range(4))
    )
    for i, (ids, _text, reason) in enumerate(results):
        assert ids == expected[f"r{i}"].token_ids
        assert reason is FinishReason.LENGTH
    await _until_idle(engine)


async def test_client_leaving_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    got = 0
    stream = engine.generate(_req("leaver", 200))
    async for out in stream:
        got += len(out.token_ids)
        if got >= 3:
            break
    await stream.aclose()
    await _until_idle(engine)
    assert engine.engine.block_manager.num_used_blocks == 0


async def test_task_cancellation_aborts(engine: AsyncEngine) -> None:
    task = asyncio.create_task(_collect(engine, _req("cancelled", 500)))
    while engine.stats().kv_blocks_used == 0:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_idle(engine)


async def test_invalid_request_raises_before_streaming(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate(GenerationRequest("bad", [65] * 300)):
            pass


async def test_duplicate_request_id_rejected(engine: AsyncEngine) -> None:
    first = engine.generate(_req("dup", 100))
    await first.__anext__()
    with pytest.raises(InvalidRequestError):
        async for _ in engine.generate(_req("dup", 5)):
            pass
    await first.aclose()
    await _until_idle(engine)


async def test_shutdown_fails_open_streams(tiny: Checkpoint) -> None:
    eng = AsyncEngine(LLMEngine(EngineConfig(num_blocks=64, block_size=8), tiny)).start()
    stream = eng.generate(_req("open", 10_000))
    await stream.__anext__()
    eng.shutdown()
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finish_reason is FinishReason.ERROR
    assert last.error == "engine stopped"
    assert eng.engine.block_manager.num_used_blocks == 0
    with pytest.raises(EngineDeadError):
        await eng.generate(_req("late")).__anext__()


class _StepSink:
    """Records each hand-over from the engine thread: a list of outputs per call."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls: list[list[str]] = []
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.failed: dict[str, BaseException] = {}

    def deliver(self, outputs: list) -> None:
        self.calls.append([o.request_id for o in outputs])
        for o in outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                self.finished.add(o.request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        self.failed[request_id] = error


async def test_a_sink_gets_all_its_requests_outputs_of_a_step_in_one_call(
    engine: AsyncEngine, tiny: Checkpoint
) -> None:
    offline = LLMEngine(EngineConfig(num_blocks=128, block_size=8), tiny)
    expected = offline.run_to_completion([_req(f"s{i}", 10, f"prompt {i}") for i in range(4)])
    sink = _StepSink()
    for i in range(4):
        engine.submit(_req(f"s{i}", 10, f"prompt {i}"), sink)
    await eventually(lambda: len(sink.finished) == 4)
    assert {rid: sink.tokens[rid] for rid in sink.finished} == {k: v.token_ids for k, v in expected.items()}
    # Four requests of ten tokens: per-request delivery would take 40 calls; a batch of four
    # takes one per step (the requests may join over a step or two).
    assert len(sink.calls) <= 14 and max(len(c) for c in sink.calls) == 4
    assert all(len(c) == len(set(c)) for c in sink.calls)  # a request at most once per hand-over


async def test_shutdown_ends_every_request_of_a_sink(engine: AsyncEngine) -> None:
    sink = _StepSink()
    for i in range(3):
        engine.submit(_req(f"d{i}", 10_000), sink)
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.submit(_req("d0", 5), sink)
    await eventually(lambda: len(sink.tokens) == 3)  # all three are running
    engine.shutdown()
    # Each ended exactly one way: an error delta (it was running) or a failure (never started).
    await eventually(lambda: sink.finished | set(sink.failed) == {"d0", "d1", "d2"})
    assert not sink.finished & set(sink.failed)


async def test_launch_builds_the_engine_on_the_thread_that_runs_its_loop(tiny: Checkpoint) -> None:
    """One thread does all the engine's torch work (AsyncEngine.launch: a second OpenMP team slowed
    every parallel region of the loop)."""
    import threading

    built_on: list[int] = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        return LLMEngine(EngineConfig(num_blocks=64, block_size=8, max_model_len=128), tiny)

    eng = AsyncEngine.launch(build)
    try:
        assert eng.alive and eng._thread is not None
        assert built_on == [eng._thread.ident] and built_on[0] != threading.get_ident()
        ids, _text, reason = await _collect(eng, _req("launched", 6))
        assert len(ids) == 6 and reason is FinishReason.LENGTH
    finally:
        eng.shutdown()
    assert not eng.alive


def test_launch_raises_what_the_build_raised() -> None:
    def build() -> LLMEngine:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncEngine.launch(build)
