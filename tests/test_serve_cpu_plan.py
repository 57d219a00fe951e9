"""``loom serve``'s CPU plan: an engine replica reserves (and so threads over) the host's cores shared
among the replicas, and a local Ray cluster offers enough CPUs for every reservation to be placed."""

from __future__ import annotations

import pytest

from loom.cmd_serve import CpuPlan, cpu_plan


@pytest.mark.parametrize(
    ("cores", "replicas", "requested", "gateway_cpus", "expected"),
    [
        (2, 1, None, 0.0, CpuPlan(2.0, 2)),  # one replica: every core (it ran on 1 thread before)
        (8, 2, None, 0.0, CpuPlan(4.0, 8)),  # shared among the replicas
        (2, 4, None, 0.0, CpuPlan(1.0, 4)),  # at least one each: the cluster offers them all
        (2, 1, None, 1.0, CpuPlan(2.0, 3)),  # two Serve-run gateways at 0.5 beside the replica
        (16, 1, 3.0, 0.0, CpuPlan(3.0, 16)),  # --replica-cpus wins
        (2, 1, 0.5, 0.5, CpuPlan(0.5, 2)),
    ],
)
def test_cpu_plan(
    cores: int, replicas: int, requested: float | None, gateway_cpus: float, expected: CpuPlan
) -> None:
    assert cpu_plan(cores, replicas, requested, gateway_cpus) == expected
