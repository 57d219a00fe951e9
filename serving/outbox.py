"""A replica's outboxes: the deltas owed to each gateway process, shipped in bulk.

Each gateway process (a *subscriber*) holds one stream per replica (``EngineReplica.deltas``); every
request it sends there (``EngineReplica.generate``) puts its outputs in that subscriber's outbox.
The engine thread fills an outbox once per step (worker/async_engine.py's sinks) and the stream
takes everything waiting at once, so one stream item carries many requests' deltas, and several
steps' when the gateway reads slower than the engine steps (as vLLM v1's engine core batches its
outputs to the front end), instead of one Ray object per request per step.

An outbox outlives a gap between two subscriptions (deltas wait in it), but not its subscriber:
requests whose subscriber has had no stream open for ``ORPHAN_S`` are aborted, so a gateway that
died cannot leave KV blocks held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from protocol.requests import RequestOutput

# A stream with nothing owed and no live request ends after this long (so a replica that drains
# is not held by idle streams); the subscriber opens a new one with its next request.
LINGER_S = 2.0
# Live requests whose subscriber has held no stream this long are aborted (the gateway is gone).
ORPHAN_S = 30.0


class Outbox:
    """One subscriber's deltas on this replica (an ``OutputSink`` for the engine)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._owed: list[RequestOutput] = []
        self._ready = asyncio.Event()
        self._live: dict[str, asyncio.Future[None]] = {}  # request id -> done when it has ended
        self._stream = 0  # the generation of the newest stream; an older one stops taking
        self.streams_open = 0
        self.unsubscribed_since: float | None = time.monotonic()

    # ---- the engine's side (OutputSink) --------------------------------------------------------

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._owed.extend(outputs)
        self._ready.set()
        for out in outputs:
            if out.finished:
                self._end(out.request_id, None)

    def fail(self, request_id: str, error: BaseException) -> None:
        self._end(request_id, error)

    # ---- requests ------------------------------------------------------------------------------

    def track(self, request_id: str) -> asyncio.Future[None]:
        """A future done when the request ends: its final output is owed, or it failed."""
        done: asyncio.Future[None] = self.loop.create_future()
        self._live[request_id] = done
        return done

    def untrack(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def _end(self, request_id: str, error: BaseException | None) -> None:
        done = self._live.pop(request_id, None)
        if done is None or done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    @property
    def live(self) -> list[str]:
        return list(self._live)

    @property
    def idle(self) -> bool:
        return not self._live and not self._owed

    # ---- the stream ----------------------------------------------------------------------------

    async def stream(self, linger_s: float = LINGER_S) -> AsyncIterator[list[RequestOutput]]:
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

    def __init__(self, abort: Callable[[str], None]) -> None:
        self._abort = abort
        self._by_subscriber: dict[str, Outbox] = {}

    def of(self, subscriber: str) -> Outbox:
        box = self._by_subscriber.get(subscriber)
        if box is None:
            box = self._by_subscriber[subscriber] = Outbox(asyncio.get_running_loop())
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
