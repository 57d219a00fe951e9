"""How a gateway process sends its requests to a deployment's replicas: several per call when they
arrive faster than calls are routed.

A Serve handle call costs the caller about 2 ms of CPU and the replica about 1.5 ms, whatever it
carries (the router's hop between loops, the replica's accept-or-reject answer, metrics): under a
burst that was most of a short request's cost on both sides. So requests go out self-clocked, like
Nagle's algorithm: with no call waiting for its replica, a request leaves in the loop tick it was
submitted in (with whatever else arrived in that tick); while one waits, later requests gather and
leave together as soon as it is routed (or after ``MAX_HOLD_S``). A lone request pays one loop tick;
a burst pays one call per routing round trip instead of one per request.

A call runs until all its requests have ended (Serve counts it ongoing meanwhile; the replica reports
its requests themselves to the autoscaler). Each request's outcome is its own future: the call's
error (a lost replica, a refusal) reaches every request of it, a request's own failure travels on
the delta stream (serving/outbox.py). A request given up is aborted by its pinned abort; the call is
cancelled only once every request in it has been given up. A retry goes alone, so the router can
steer it away from the replica that failed it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, cast

from ray.serve.handle import DeploymentHandle, DeploymentResponse

from protocol.requests import GenerationRequest

# A call not routed this long does not hold the next ones back any more (Serve queues them all).
MAX_HOLD_S = 0.05
MAX_REQUESTS_PER_CALL = 64


@dataclass
class _Call:
    requests: list[GenerationRequest]
    outcomes: list[asyncio.Future[None]]
    response: DeploymentResponse[None] | None = None
    given_up: set[str] = field(default_factory=set)


class Dispatcher:
    """One deployment's calls from this process (owned by its ServeEnginePool)."""

    def __init__(self, handle: DeploymentHandle[Any], subscriber: str) -> None:
        self._handle = handle
        self._subscriber = subscriber
        self._pending: list[tuple[GenerationRequest, asyncio.Future[None]]] = []
        self._call_of: dict[str, _Call] = {}
        self._waiting: _Call | None = None  # the newest call not yet routed
        self._flush: asyncio.TimerHandle | asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.calls = 0  # calls sent (what the batching saves is requests / calls)

    def submit(self, request: GenerationRequest) -> asyncio.Future[None]:
        """Send ``request``; the future ends when its call does: None, or the call's error."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[None] = loop.create_future()
        if request.retry_of is not None:
            self._send([(request, outcome)])
            return outcome
        self._pending.append((request, outcome))
        if self._flush is None:
            if self._waiting is None:
                self._flush = loop.call_soon(self._send_pending)
            else:
                self._flush = loop.call_later(MAX_HOLD_S, self._send_pending)
        return outcome

    def routed(self, request_id: str) -> None:
        """The router placed ``request_id``: if it opened the waiting call, the next may leave."""
        waiting = self._waiting
        if waiting is not None and waiting.requests[0].request_id == request_id:
            self._release_waiting()

    def give_up(self, request_id: str) -> None:
        """The request's caller left before its end (it is aborted on its replica by its pin)."""
        for i, (request, outcome) in enumerate(self._pending):
            if request.request_id == request_id:
                del self._pending[i]
                outcome.cancel()
                return
        call = self._call_of.get(request_id)
        if call is None:
            return
        call.given_up.add(request_id)
        if len(call.given_up) == len(call.requests) and call.response is not None:
            call.response.cancel()  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- calls -------------------------------------------------------------------------------------

    def _release_waiting(self) -> None:
        self._waiting = None
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._pending:
            self._send_pending()

    def _send_pending(self) -> None:
        self._flush = None
        while self._pending:
            batch, self._pending = (
                self._pending[:MAX_REQUESTS_PER_CALL],
                self._pending[MAX_REQUESTS_PER_CALL:],
            )
            self._send(batch)

    def _send(self, batch: list[tuple[GenerationRequest, asyncio.Future[None]]]) -> None:
        call = _Call([r for r, _ in batch], [o for _, o in batch])
        for request in call.requests:
            self._call_of[request.request_id] = call
        call.response = cast(
            DeploymentResponse[None], self._handle.generate.remote(call.requests, self._subscriber)
        )
        self.calls += 1
        self._waiting = call
        task = asyncio.get_running_loop().create_task(self._await(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await(self, call: _Call) -> None:
        assert call.response is not None
        error: BaseException | None = None
        try:
            await call.response
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                call.response.cancel()  # type: ignore[no-untyped-call]
            raise
        except BaseException as exc:  # handed to each request's reader, which decides
            error = exc
        finally:
            for request in call.requests:
                if self._call_of.get(request.request_id) is call:
                    del self._call_of[request.request_id]
            if self._waiting is call:  # refused or failed before routing: the next may leave
                self._release_waiting()
        for outcome in call.outcomes:
            if outcome.done():
                continue
            if error is None:
                outcome.set_result(None)
            else:
                outcome.set_exception(error)
