"""A replica's outboxes: the deltas owed to each gateway process, shipped in bulk.

Each gateway process (a *subscriber*) holds one stream per replica (``EngineReplica.deltas``); every
request it sends there (``EngineReplica.generate``) puts its outputs in that subscriber's outbox.
The engine thread fills an outbox once per step (worker/async_engine.py's sinks) and the stream
takes everything waiting at once, so one stream item carries many requests' deltas, and several
steps' when the gateway reads slower than the engine steps (as vLLM v1's engine core batches its
outputs to the front end), instead of one Ray object per request per step.

With a stream interval above 1, a request's deltas after its first wait in the outbox until they
hold that many tokens (or the request ends), merged into one: the gateway then wakes, encodes and
writes once per interval instead of once per token, at the cost of a smoother stream.

An outbox outlives a gap between two subscriptions (deltas wait in it), but not its subscriber:
requests whose subscriber has had no stream open for ``ORPHAN_S`` are aborted, so a gateway that
died cannot leave KV blocks held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from protocol.requests import RequestOutput

# A stream with nothing owed and no live request ends after this long (so a replica that drains
# is not held by idle streams); the subscriber opens a new one with its next request.
LINGER_S = 2.0
# Live requests whose subscriber has held no stream this long are aborted (the gateway is gone).
ORPHAN_S = 30.0


@dataclass(frozen=True)
class RequestFailed:
    """On the stream in place of a delta: the request ended with this error on the replica (refused
    by the engine, or the engine died). It travels with the deltas, not as the call's error, because
    a call carries several requests (serving/dispatch.py) and each fails alone."""

    request_id: str
    error: BaseException


class Outbox:
    """One subscriber's deltas on this replica (an ``OutputSink`` for the engine)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream_interval: int = 1) -> None:
        self.loop = loop
        self.stream_interval = stream_interval
        self._owed: list[RequestOutput | RequestFailed] = []
        # A started request's outputs short of the interval, and their tokens (merged when shipped).
        self._held: dict[str, tuple[list[RequestOutput], int]] = {}
        self._started: set[str] = set()  # requests whose first delta was shipped
        self._ready = asyncio.Event()
        self._live: dict[str, asyncio.Future[None]] = {}  # request id -> done when it has ended
        self._stream = 0  # the generation of the newest stream; an older one stops taking
        self.streams_open = 0
        self.unsubscribed_since: float | None = time.monotonic()

    # ---- the engine's side (OutputSink) --------------------------------------------------------

    def deliver(self, outputs: list[RequestOutput]) -> None:
        if self.stream_interval > 1:
            outputs = self._coalesce(outputs)
        if outputs:
            self._owed.extend(outputs)
            self._ready.set()
        for out in outputs:
            if out.finished:
                self._end(out.request_id)

    def _coalesce(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs due now: a request's first at once, later ones once they hold
        ``stream_interval`` tokens or end; the rest are held, merged."""
        due: list[RequestOutput] = []
        for out in outputs:
            rid = out.request_id
            if rid in self._started and not out.finished:
                parts, tokens = self._held.get(rid) or ([], 0)
                parts.append(out)
                tokens += len(out.token_ids)
                if tokens < self.stream_interval:
                    self._held[rid] = (parts, tokens)
                    continue
                self._held.pop(rid, None)
                out = merged(parts)
            elif rid in self._held:
                out = merged([*self._held.pop(rid)[0], out])
            if out.finished:
                self._started.discard(rid)
            elif out.token_ids:  # the first token goes out at once: time to first token is kept
                self._started.add(rid)
            due.append(out)
        return due

    def fail(self, request_id: str, error: BaseException) -> None:
        held = self._forget(request_id)
        if held:  # what was made before the failure is still the client's
            self._owed.append(merged(held))
        self._owed.append(RequestFailed(request_id, error))
        self._ready.set()
        self._end(request_id)

    def _forget(self, request_id: str) -> list[RequestOutput]:
        """Stop holding the request's outputs; those held so far."""
        self._started.discard(request_id)
        held = self._held.pop(request_id, None)
        return held[0] if held is not None else []

    # ---- requests ------------------------------------------------------------------------------

    def track(self, request_id: str) -> asyncio.Future[None]:
        """A future done when the request ends: its final output, or its failure, is owed."""
        done: asyncio.Future[None] = self.loop.create_future()
        self._live[request_id] = done
        return done

    def untrack(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._forget(request_id)  # its caller is gone: what was held goes nowhere

    def _end(self, request_id: str) -> None:
        done = self._live.pop(request_id, None)
        if done is not None and not done.done():
            done.set_result(None)

    @property
    def live(self) -> list[str]:
        return list(self._live)

    @property
    def idle(self) -> bool:
        return not self._live and not self._owed and not self._held

    # ---- the stream ----------------------------------------------------------------------------

    async def stream(self, linger_s: float = LINGER_S) -> AsyncIterator[list[RequestOutput | RequestFailed]]:
        """Batches of owed deltas until nothing is owed or live for ``linger_s``. A newer stream of
        the same subscriber supersedes this one (two readers would reorder a request's deltas)."""
        self._stream += 1
        mine = self._stream
        self.streams_open += 1
        self.unsubscribed_since = None
        self._ready.set()  # an older stream still waiting wakes and sees it is superseded
        try:
            yield []  # the handshake: the subscriber knows its stream is open
            while mine == self._stream:
                if not self._owed:
                    try:
                        async with asyncio.timeout(linger_s):  # a timer, not a task, per wait
                            await self._ready.wait()
                    except TimeoutError:
                        if self.idle:
                            return
                        continue
                    if mine != self._stream:
                        return
                self._ready.clear()
                batch, self._owed = self._owed, []
                if batch:
                    yield batch
        finally:
            self.streams_open -= 1
            if self.streams_open == 0:
                self.unsubscribed_since = time.monotonic()
            self._ready.set()  # an older stream waiting on the event re-checks whether it is current


class Outboxes:
    """This replica's outboxes by subscriber."""

    def __init__(self, abort: Callable[[str], None], stream_interval: int = 1) -> None:
        self._abort = abort
        self._stream_interval = stream_interval
        self._by_subscriber: dict[str, Outbox] = {}

    def of(self, subscriber: str) -> Outbox:
        box = self._by_subscriber.get(subscriber)
        if box is None:
            box = Outbox(asyncio.get_running_loop(), self._stream_interval)
            self._by_subscriber[subscriber] = box
        return box

    def sweep(self, now: float | None = None, orphan_s: float = ORPHAN_S) -> list[str]:
        """Abort the requests of subscribers without a stream for ``orphan_s``, and forget idle
        outboxes nobody reads; the request ids aborted."""
        now = time.monotonic() if now is None else now
        aborted: list[str] = []
        for subscriber, box in list(self._by_subscriber.items()):
            gone = box.unsubscribed_since is not None and now - box.unsubscribed_since > orphan_s
            if gone:
                for request_id in box.live:
                    self._abort(request_id)
                    aborted.append(request_id)
            if box.streams_open == 0 and (box.idle or gone):
                del self._by_subscriber[subscriber]
        return aborted

    def __len__(self) -> int:
        return len(self._by_subscriber)


def merged(parts: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: tokens, text and log-probabilities joined, the last
    one's end and counts, the first one's cached prompt tokens."""
    first, last = parts[0], parts[-1]
    if len(parts) == 1:
        return first
    logprobs = None
    if any(p.logprobs is not None for p in parts):
        logprobs = [lp for p in parts for lp in (p.logprobs or [])]
    return dataclasses.replace(
        last,
        text="".join(p.text for p in parts),
        token_ids=[t for p in parts for t in p.token_ids],
        cached_prompt_tokens=first.cached_prompt_tokens,
        logprobs=logprobs,
    )
