"""A gateway process's delta streams: one per engine replica, carrying all its requests there.

A request goes to a replica in a call (``EngineReplica.generate``, routed by Loom's router; several
requests per call in a burst: serving/dispatch.py); its deltas, or the error that failed it there,
come back on this process's stream from that replica (``EngineReplica.deltas``, pinned to it), which
carries every request of this process on that replica, many per item. So a streamed token
costs the gateway a share of one Ray item per engine step instead of a Ray item of its own.

The router says which replica accepted a request (``ReplicaStatsRegistry.routed``); the first
request to a replica opens the stream there (deltas wait in the replica's outbox meanwhile), and it
is opened again while requests remain when the replica ends it for idleness. A stream that fails
fails the requests on its replica with the error (a lost replica: the pool retries or resumes them).
A request given up before its end is aborted on its replica by a call pinned there, once the
router has said which replica that is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from protocol.requests import RequestOutput
from serving.outbox import RequestFailed
from serving.pinning import Pinned, ReplicaGoneError
from serving.replica_stats import ReplicaStatsRegistry

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0  # a backstop: a pin to a replica gone is refused at once (router.py)
# How long a first stream to a replica may be refused as gone: this process's router learns of new
# replicas by Serve's long poll, so a replica can take a request (another router placed it) before
# the router that pins delta streams lists it. A replica really gone fails its requests' calls anyway.
PIN_LAG_S = 5.0
PIN_RETRY_S = 0.1
MAX_ABANDONED = 10_000  # requests given up before the router said where they went, remembered


class CallEnded:
    """Put in a request's queue when its call returned normally: its final delta is due."""


CALL_ENDED = CallEnded()
# What a request's queue holds: its deltas, the error that ends it, or word that its call returned.
Item = RequestOutput | BaseException | CallEnded


@dataclass
class _Follower:
    """This process's stream from one replica."""

    task: asyncio.Task[None] | None = None
    opened: bool = False  # the replica's handshake arrived: it is there and serving the stream
    ever_opened: bool = False
    requests: set[str] = field(default_factory=set)  # this process's requests on that replica


class DeltaStreams:
    """Routes every delta that arrives from a replica to its request's queue."""

    def __init__(
        self, handle: DeploymentHandle[Any], deployment: str, registry: ReplicaStatsRegistry
    ) -> None:
        self.subscriber = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"
        self._handle = handle.options(stream=True)
        self._unary = handle
        self._deployment = deployment
        self._registry = registry
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._replica_of: dict[str, str] = {}
        self._followers: dict[str, _Follower] = {}
        self._abandoned: OrderedDict[str, None] = OrderedDict()  # given up before routed: abort there
        self._aborts: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_routed: Callable[[str], None] | None = None  # told of each of our requests placed
        registry.listen_routed(deployment, self._routed_threadsafe)

    def open(self, request_id: str) -> asyncio.Queue[Item]:
        """The queue ``request_id``'s deltas (or the error that ends it) will arrive in."""
        self._loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def release(self, request_id: str, *, abort: bool = False) -> None:
        """The request is over for this process: later deltas of it are dropped. With ``abort``
        (given up before its end), it is stopped on its replica, now or once routed."""
        self._queues.pop(request_id, None)
        replica = self._replica_of.pop(request_id, None)
        if abort:
            if replica is None:
                self._abandoned[request_id] = None
                while len(self._abandoned) > MAX_ABANDONED:
                    self._abandoned.popitem(last=False)
            else:
                self._abort(replica, request_id)
        follower = self._followers.get(replica) if replica is not None else None
        if follower is None:
            return
        follower.requests.discard(request_id)
        if not follower.requests and not follower.opened and follower.task is not None:
            follower.task.cancel()  # never opened: the replica may be gone, stop asking the router

    async def close(self) -> None:
        """Stop every stream and abort in flight, and wait for them: a Ray stream touched after Ray
        shut down ends the whole process (its core worker exits)."""
        self._registry.unlisten_routed(self._deployment, self._routed_threadsafe)
        tasks = [f.task for f in self._followers.values() if f.task is not None] + list(self._aborts)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the router's news -------------------------------------------------------------------------

    def _routed_threadsafe(self, request_id: str, replica_id: str) -> None:
        """On the router's thread: every request of the deployment passes here, ours or not."""
        loop = self._loop
        if loop is None or (request_id not in self._queues and request_id not in self._abandoned):
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(self._routed, request_id, replica_id)

    def _routed(self, request_id: str, replica_id: str) -> None:
        if self.on_routed is not None:
            self.on_routed(request_id)
        if request_id in self._abandoned:
            del self._abandoned[request_id]
            self._abort(replica_id, request_id)
            return
        if request_id not in self._queues:
            return
        self._replica_of[request_id] = replica_id
        follower = self._followers.get(replica_id)
        if follower is None:
            follower = self._followers[replica_id] = _Follower()
            follower.task = asyncio.get_running_loop().create_task(self._follow(replica_id, follower))
        follower.requests.add(request_id)

    def _abort(self, replica_id: str, request_id: str) -> None:
        async def send() -> None:
            try:
                async with asyncio.timeout(ABORT_TIMEOUT_S):
                    await self._unary.abort.remote(Pinned(replica_id, self.subscriber), request_id)
            except Exception as exc:  # the replica is gone: so is the request
                log.info("abort of %s on replica %s: %r", request_id, replica_id, exc)

        task = asyncio.get_running_loop().create_task(send())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    # ---- one replica's stream ----------------------------------------------------------------------

    async def _follow(self, replica_id: str, follower: _Follower) -> None:
        refused_since: float | None = None
        try:
            while follower.requests:
                try:
                    await self._read(replica_id, follower)
                except ReplicaGoneError:
                    now = time.monotonic()
                    refused_since = refused_since or now
                    if follower.ever_opened or now - refused_since > PIN_LAG_S:
                        raise
                    await asyncio.sleep(PIN_RETRY_S)  # the router may not list that replica yet
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica is lost (or the stream broke): its requests end with it
            log.warning("the delta stream from replica %s failed: %r", replica_id, exc)
            for request_id in follower.requests:
                self._replica_of.pop(request_id, None)
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(exc)
            follower.requests.clear()
        finally:
            if self._followers.get(replica_id) is follower:
                del self._followers[replica_id]

    async def _read(self, replica_id: str, follower: _Follower) -> None:
        # A handle with stream=True answers a generator (its type cannot say so).
        stream = cast(
            DeploymentResponseGenerator[list[RequestOutput | RequestFailed]],
            self._handle.deltas.remote(Pinned(replica_id, self.subscriber)),
        )
        ended = False
        try:
            async for batch in stream:
                follower.opened = follower.ever_opened = True
                queues = self._queues
                for out in batch:
                    queue = queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out if isinstance(out, RequestOutput) else out.error)
            ended = True
        finally:
            follower.opened = False
            if not ended:
                stream.cancel()  # type: ignore[no-untyped-call]
