"""Where the stats of remote engine replicas are published in a process, and read back.

Loom's request router receives each replica's published ``EngineStats`` from Ray Serve and records
them here; the gateway's pools and its metrics collector read them from the same registry. The
router also says here which replica took each request (``routed``), so the pool opens its delta
stream to that replica (serving/delta_streams.py). Serve
builds the router itself (from a class it ships by value), so nothing can be passed to it: it
publishes to :func:`process_registry`, which lives in this module (shipped by reference) and is
therefore the same object the gateway in that process is handed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from protocol.stats import EngineStats

# A replica whose forward passes fail this many times in a row reports unhealthy (Serve replaces it),
# and routers rank it behind every healthy one: one failure can be a single request's fault, a run of
# them is the replica's.
UNHEALTHY_AFTER_FAILED_STEPS = 3

# Called with (request id, replica id) on the router's thread, once the replica accepted the request.
RoutedListener = Callable[[str, str], None]


class ReplicaStatsRegistry:
    """The latest stats per replica, by deployment (``"app/deployment"``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_deployment: dict[str, dict[str, EngineStats]] = {}
        self._listeners: dict[str, list[RoutedListener]] = {}

    def publish(self, deployment: str, replicas: dict[str, EngineStats]) -> None:
        """Replace the deployment's view: replicas absent from ``replicas`` are gone."""
        with self._lock:
            self._by_deployment[deployment] = dict(replicas)

    def replicas(self, deployment: str) -> dict[str, EngineStats]:
        with self._lock:
            return dict(self._by_deployment.get(deployment, {}))

    def listen_routed(self, deployment: str, listener: RoutedListener) -> None:
        with self._lock:
            self._listeners.setdefault(deployment, []).append(listener)

    def unlisten_routed(self, deployment: str, listener: RoutedListener) -> None:
        with self._lock:
            listeners = self._listeners.get(deployment, [])
            if listener in listeners:
                listeners.remove(listener)

    def routed(self, deployment: str, request_id: str, replica_id: str) -> None:
        with self._lock:
            listeners = list(self._listeners.get(deployment, ()))
        for listener in listeners:
            listener(request_id, replica_id)


_PROCESS_REGISTRY = ReplicaStatsRegistry()


def process_registry() -> ReplicaStatsRegistry:
    """The registry this process's request routers publish to."""
    return _PROCESS_REGISTRY
