"""Loom's Ray Serve request router: load- and prefix-aware replica choice for engine replicas.

It runs inside the caller's process (the gateway's DeploymentHandle). Each replica publishes
``record_routing_stats`` (KV usage, running and waiting requests by priority) every second; between
two publications the router counts what it has sent each replica itself, so a burst does not pile
onto the replica that looked idlest at the last publication.

Prefix affinity: requests of one tenant that start with the same tokens go to the replica that
served that prefix last (its prefix cache holds the blocks), as long as that replica's load is within
a tolerance of the least loaded one; otherwise load wins and the prefix moves. A request for a LoRA
adapter with no prefix history prefers, within the same tolerance, a replica that holds the adapter in
a slot already (as Ray Serve's model multiplexing does): no load from disk, no eviction.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from common import Priority
from protocol.requests import GenerationRequest
from protocol.stats import EngineStats
from serving.pinning import Pinned  # by reference: see serving/pinning.py
from serving.replica_stats import UNHEALTHY_AFTER_FAILED_STEPS, process_registry

log = logging.getLogger(__name__)

ROUTER_CLASS = "serving.router:LoomRequestRouter"
R = TypeVar("R")

AFFINITY_TOKENS = 128  # prompt tokens that identify a shared prefix
AFFINITY_TOLERANCE = 0.25  # load-score slack a preferred replica may have over the least loaded
MAX_AFFINITY_ENTRIES = 50_000
MAX_REMEMBERED_REQUESTS = 10_000  # which replica took each recent request, to steer its retry away
FAILING_PENALTY = 10.0  # per failed step in a row: behind every healthy replica, however loaded


def load_score(stats: EngineStats | None, priority: Priority, sent_since_stats: int) -> float:
    """Lower is better: KV pressure plus the work queued at or above this request's class."""
    if stats is None:
        return 0.5 + 0.05 * sent_since_stats  # unknown yet: neither preferred nor avoided
    ahead = stats.waiting_at_or_above(priority)
    load = stats.kv_cache_usage + 0.05 * (ahead + sent_since_stats) + 0.002 * stats.num_running
    # A replica whose steps fail finishes everything at once and looks idle: idle must not mean best.
    return load + FAILING_PENALTY * min(stats.consecutive_failed_steps, UNHEALTHY_AFTER_FAILED_STEPS)


def affinity_key(request: GenerationRequest) -> bytes:
    head = request.prompt_token_ids[:AFFINITY_TOKENS]
    adapter = request.adapter.id.encode() if request.adapter is not None else b""
    return hashlib.blake2b(request.cache_salt + adapter + array("q", head).tobytes(), digest_size=12).digest()


def adapter_holder(candidates: list[Candidate], stats: dict[str, EngineStats], adapter_id: str) -> str | None:
    """The least loaded replica that already holds the adapter in a slot (no load, no eviction)."""
    holding = [
        c for c in candidates if c.replica_id in stats and adapter_id in stats[c.replica_id].loaded_adapters
    ]
    return min(holding, key=lambda c: (c.score, c.replica_id)).replica_id if holding else None


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    score: float


def rank(
    candidates: list[Candidate],
    preferred: str | None,
    tolerance: float = AFFINITY_TOLERANCE,
    avoid: str | None = None,
) -> list[str]:
    """Replica ids best first: the prefix's replica if its load is close enough, then by load; the
    replica to ``avoid`` (it failed this request) last, whatever its load."""
    ordered = sorted(candidates, key=lambda c: (c.replica_id == avoid, c.score, c.replica_id))
    if preferred is not None and preferred != avoid and ordered:
        best = ordered[0].score
        for i, c in enumerate(ordered):
            if c.replica_id == preferred and c.score <= best + tolerance:
                ordered.insert(0, ordered.pop(i))
                break
    return [c.replica_id for c in ordered]


def pinned_choice(pinned: Pinned, by_id: dict[str, R]) -> list[list[R]]:
    """That replica; if the router no longer lists it, any (which refuses the call at once)."""
    if pinned.replica_id in by_id:
        return [[by_id[pinned.replica_id]]]
    # A pin misses when its replica is gone (or not yet listed by this router): say what it lists.
    log.warning("pinned to replica %s, not listed by this router (%s)", pinned.replica_id, sorted(by_id))
    return [list(by_id.values())]


def _pinned_of(pending: PendingRequest | None) -> Pinned | None:
    if pending is None:
        return None
    return next((a for a in (*pending.args, *pending.kwargs.values()) if isinstance(a, Pinned)), None)


def _requests_of(pending: PendingRequest | None) -> list[GenerationRequest]:
    """The requests a call carries (``EngineReplica.generate`` takes a list: serving/dispatch.py)."""
    if pending is None:
        return []
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, GenerationRequest):
            return [arg]
        if isinstance(arg, list) and arg and isinstance(arg[0], GenerationRequest):
            return arg
    return []


class LoomRequestRouter(RequestRouter):
    """Each request gets the replica chosen for it (Serve's default matching by request id; a FIFO
    mixin would hand the choice to whichever request waits longest, losing pins and affinity)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._affinity: OrderedDict[bytes, str] = OrderedDict()
        self._sent: dict[str, int] = defaultdict(int)
        self._stats_seen: dict[str, int] = {}
        self._stats: dict[str, EngineStats] = {}
        self._registry = process_registry()
        self._served_by: OrderedDict[str, str] = OrderedDict()  # recent request id -> its replica

    def _deployment_key(self) -> str:
        dep = self._deployment_id
        return f"{dep.app_name}/{dep.name}"

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live: dict[str, EngineStats] = {}
        for r in replicas:
            rid = r.replica_id.unique_id
            raw = r.routing_stats
            if not raw:
                continue
            if self._stats_seen.get(rid) != id(raw):  # a fresh publication: reset our own count
                self._stats_seen[rid] = id(raw)
                self._sent[rid] = 0
                self._stats[rid] = EngineStats.from_dict(raw)
            live[rid] = self._stats[rid]
        self._stats = live
        self._registry.publish(self._deployment_key(), live)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pinned = _pinned_of(pending_request)
        if pinned is not None:
            return pinned_choice(pinned, by_id)
        # A call of several requests is placed as one: at its most urgent class, by its first
        # request's prefix and adapter (a retry always goes alone, so ``avoid`` is its own).
        requests = _requests_of(pending_request)
        request = requests[0] if requests else None
        priority = min((r.priority for r in requests), default=Priority.STANDARD)
        scored = [
            Candidate(rid, load_score(self._stats.get(rid), priority, self._sent[rid]))
            for rid, r in by_id.items()
        ]
        preferred = self._affinity.get(affinity_key(request)) if request is not None else None
        if preferred is None and request is not None and request.adapter is not None:
            preferred = adapter_holder(scored, self._stats, request.adapter.id)
        avoid = self._served_by.get(request.retry_of) if request is not None and request.retry_of else None
        return [[by_id[rid]] for rid in rank(scored, preferred, avoid=avoid)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        # A pinned call (a delta stream, an abort) carries no request and is no load.
        for request in _requests_of(pending_request):
            self._sent[rid] += 1
            self._registry.routed(self._deployment_key(), request.request_id, rid)
            self._served_by[request.request_id] = rid
            key = affinity_key(request)
            self._affinity[key] = rid
            self._affinity.move_to_end(key)
        while len(self._served_by) > MAX_REMEMBERED_REQUESTS:
            self._served_by.popitem(last=False)
        while len(self._affinity) > MAX_AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
