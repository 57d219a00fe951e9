"""What each engine replica is doing while it starts, for whoever waits on it (``loom serve``).

A replica's constructor takes from seconds (a warm machine) to minutes (a first kernel build, a large
model read from a slow disk), and Serve reports only that the replica is STARTING. So the replica
writes its phase into Ray's key-value store in the cluster's GCS as it goes, and ``loom serve`` prints
each change together with the replica states Serve reports (a replica waiting for CPUs, say).
Reports are best effort: a phase that cannot be written is not a reason to fail a start.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass

_NAMESPACE = "loom"
_PREFIX = "start-phase/"


@dataclass(frozen=True)
class Phase:
    deployment: str
    replica: str
    phase: str
    since: float  # wall-clock seconds (replicas may run on other nodes: no shared monotonic clock)


def report(deployment: str, replica: str, phase: str) -> None:
    """Called in the replica at each phase of its start; ``ready`` ends it."""
    with contextlib.suppress(Exception):
        from ray.experimental.internal_kv import _internal_kv_put

        value = json.dumps({"phase": phase, "since": time.time()})
        _internal_kv_put(f"{_PREFIX}{deployment}/{replica}", value, overwrite=True, namespace=_NAMESPACE)


def current() -> list[Phase]:
    """Every replica's latest phase (those of replicas long gone included: callers filter by time)."""
    with contextlib.suppress(Exception):
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

        phases = []
        for key in _internal_kv_list(_PREFIX, namespace=_NAMESPACE):
            raw = _internal_kv_get(key, namespace=_NAMESPACE)
            if raw is None:
                continue
            deployment, _, replica = key.decode().removeprefix(_PREFIX).rpartition("/")
            data = json.loads(raw)
            phases.append(Phase(deployment, replica, str(data["phase"]), float(data["since"])))
        return sorted(phases, key=lambda p: (p.deployment, p.replica))
    return []


def replica_states() -> dict[str, dict[str, int]]:
    """Serve's replica states per deployment (``{"engine-shared": {"STARTING": 1}}``)."""
    with contextlib.suppress(Exception):
        from ray import serve

        states: dict[str, dict[str, int]] = {}
        for app in serve.status().applications.values():
            for name, deployment in app.deployments.items():
                states[name] = {str(state): n for state, n in deployment.replica_states.items()}
        return states
    return {}


class StartWatcher:
    """Lines worth printing since the last poll: phase changes of replicas, and Serve's states."""

    def __init__(self, since: float | None = None) -> None:
        self._since = time.time() if since is None else since
        self._seen: dict[tuple[str, str], str] = {}
        self._states: dict[str, dict[str, int]] = {}

    def poll(self) -> list[str]:
        lines = []
        states = replica_states()
        for deployment, counts in sorted(states.items()):
            if counts != self._states.get(deployment):
                text = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
                lines.append(f"{deployment}: replicas {text}")
        self._states = states
        for p in current():
            if p.since < self._since or self._seen.get((p.deployment, p.replica)) == p.phase:
                continue
            self._seen[(p.deployment, p.replica)] = p.phase
            lines.append(f"{p.deployment} replica {p.replica}: {p.phase}")
        return lines
