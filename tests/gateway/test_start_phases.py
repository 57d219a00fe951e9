"""What `loom serve` prints while replicas start: each replica's phase, read from Ray's GCS."""

from __future__ import annotations

import time
from typing import Any

from serving import start_phases


def test_every_started_replica_reported_its_phases_up_to_ready(engine_handles: dict[str, Any]) -> None:
    phases = start_phases.current()
    by_deployment = {p.deployment: p for p in phases if p.phase == "ready"}
    assert {"engine-shared", "engine-vip"} <= set(by_deployment)
    assert all(p.since <= time.time() for p in phases)
    watcher = start_phases.StartWatcher(since=0.0)
    lines = watcher.poll()
    assert any(line.startswith("engine-vip replica ") and line.endswith(": ready") for line in lines)
    assert any("RUNNING" in line for line in lines)  # Serve's own replica states beside them
    assert not any("replica" in line and ": ready" in line for line in watcher.poll())  # only changes


def test_a_reported_phase_is_read_back_by_deployment_and_replica(engine_handles: dict[str, Any]) -> None:
    start_phases.report("engine-test", "r-test", "loading")
    assert any(p.replica == "r-test" and p.phase == "loading" for p in start_phases.current())
