"""The asyncio face of the engine: add a request, iterate its deltas, abort it by id.

The engine steps in one background thread (torch releases the GIL in its kernels, so the event loop
stays responsive); requests and aborts reach it through a queue, outputs come back to each caller's
event loop with ``call_soon_threadsafe``. A caller that stops iterating (client gone, task
cancelled) aborts its request, so its KV blocks are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from protocol.commands import AbortRequest, AddRequest, EngineCommand
from protocol.requests import (
    EngineDeadError,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    RequestOutput,
)
from protocol.stats import EngineStats
from worker.engine import LLMEngine

log = logging.getLogger(__name__)


class OutputSink(Protocol):
    """Where the outputs of some requests go; both methods run on the sink's own loop."""

    loop: asyncio.AbstractEventLoop

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs of this sink's requests, in request order."""

    def fail(self, request_id: str, error: BaseException) -> None:
        """The request ended without a final output (refused by the engine, or the engine died)."""


class _RequestSink:
    """One request's outputs as a queue its caller iterates (AsyncEngine.generate)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.queue.put_nowait(out)

    def fail(self, request_id: str, error: BaseException) -> None:
        self.queue.put_nowait(error)


def _on_loop(sink: OutputSink, method: Callable[..., None], *args: Any) -> None:
    # A closed loop (RuntimeError) means nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        sink.loop.call_soon_threadsafe(method, *args)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wake = engine.wakeup  # one event: a command or a finished adapter load wakes the loop
        self._sinks: dict[str, OutputSink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    @classmethod
    def launch(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Build the engine on the thread that will run its loop, start the loop there, and return
        once it is built (raising what the build raised).

        Why on that thread: OpenMP (libgomp, under torch) keeps a team of worker threads for each
        thread that ever ran a parallel region. A model loaded on the caller's thread leaves a second
        team behind; with more OpenMP threads than cores, libgomp lets idle workers spin only ~100
        times before sleeping, so every parallel region of the loop pays a futex wake-up. Measured on
        2 cores: a tiny parallel op 8 us from the only team, 85 us beside another; a served step of
        96 streams 101 ms against 59 ms offline. One thread, one team.
        """
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def run() -> None:
            # Named before the build, so the OpenMP workers it starts carry the loop's name too.
            name_os_thread("loom-engine")
            try:
                engine = cls(build())
            except BaseException as exc:
                built.put(exc)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine._loop()

        threading.Thread(target=run, name="loom-engine", daemon=True).start()
        got = built.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loom-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; every unfinished request ends with an error delta."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``request``'s deltas; the last one carries ``finish_reason`` and the counts.

        Raises InvalidRequestError before streaming anything if the engine cannot serve it.
        """
        sink = _RequestSink(asyncio.get_running_loop())
        self.submit(request, sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def submit(self, request: GenerationRequest, sink: OutputSink) -> None:
        """Start ``request``; its outputs go to ``sink`` (with those of the sink's other requests).

        Raises InvalidRequestError (or EngineDeadError) at once if the engine cannot serve it; a
        refusal found later, on the engine thread, reaches ``sink.fail``. Thread-safe.
        """
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.engine.validate(request)
        with self._lock:
            if request.request_id in self._sinks:
                raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
            self._sinks[request.request_id] = sink
        self._commands.put(AddRequest(request))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop ``request_id``; its blocks are freed before the next step."""
        self._commands.put(AbortRequest(request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (cheap; never blocks on the engine)."""
        return self._stats

    # ---- the engine thread ---------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each sink its share of ``outputs`` in one call on its loop."""
        batches: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._sinks.pop(out.request_id, None)
                if sink is None:
                    continue
                batch = batches.get(id(sink))
                if batch is None:
                    batches[id(sink)] = (sink, [out])
                else:
                    batch[1].append(out)
        for sink, batch_outputs in batches.values():
            _on_loop(sink, sink.deliver, batch_outputs)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case AddRequest(request=req):
                    try:
                        self.engine.add_request(req)
                    except Exception as exc:  # validation raced a config change, or a duplicate id
                        with self._lock:
                            sink = self._sinks.pop(req.request_id, None)
                        if sink is not None:
                            _on_loop(sink, sink.fail, req.request_id, exc)
                case AbortRequest(request_id=rid):
                    out = self.engine.abort(rid)
                    if out is not None:
                        self._deliver([out])

    def _loop(self) -> None:
        name_os_thread("loom-engine")
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                self._stats = self.engine.stats()
                if (
                    self.engine.stalled()
                ):  # waiting on an adapter load: sleep until it (or a command) wakes us
                    self.engine.wait_for_progress(timeout=0.5)
        except BaseException as exc:  # the loop must never die silently with callers waiting
            log.exception("engine loop crashed")
            self._error = exc
        finally:
            self._fail_all()

    def _fail_all(self) -> None:
        reason = "engine stopped" if self._error is None else f"engine crashed: {self._error}"
        for rid in self.engine.unfinished_request_ids():
            out = self.engine.abort(rid, FinishReason.ERROR)
            if out is not None:
                out.error = reason
                self._deliver([out])
        with self._lock:
            sinks, self._sinks = dict(self._sinks), {}
        for rid, sink in sinks.items():
            _on_loop(sink, sink.fail, rid, EngineDeadError(reason))


def name_os_thread(name: str) -> None:
    """Give the calling thread its name at the OS level too (``top -H``, py-spy, ``/proc``), so the
    engine loop's CPU can be told from the rest of a replica's (loadtest/bench_stream_cost.py);
    threads it starts afterwards inherit the name. Linux only; elsewhere nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
