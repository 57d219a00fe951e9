"""``loom bench served``: the experiments' plan and the figures it sets beside the targets, on hand-made
reports (the runs themselves take 40 minutes and are committed under loadtest/results/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench_served import WORKLOADS, servers, summarize, to_markdown
from loadtest.workload import load_workload


def _report(tenants: dict[str, tuple[float, float]], step_s: float = 0.05) -> dict[str, Any]:
    """A report of one stage: per tenant (p99 TTFT, output tok/s)."""
    groups = {
        t: {"ttft_s": {"p50": p99 / 2, "p99": p99}, "output_tokens_per_s": tps}
        for t, (p99, tps) in tenants.items()
    }
    return {
        "stages": [
            {
                "stats": {"tenants": groups, "overall": {}},
                "utilization": {"all": None, "replicas": {"engine-shared#1": {"mean_step_s": step_s}}},
            }
        ]
    }


def test_priority_and_fairness_figures_follow_the_reports() -> None:
    s = summarize(
        {
            "priority-chat-alone": _report({"chat": (0.10, 5.0)}),
            "priority-bulk-alone": _report({"bulk": (9.0, 200.0)}),
            "priority-on": _report({"chat": (0.18, 5.0), "bulk": (30.0, 170.0)}, step_s=0.04),
            "priority-off": _report({"chat": (12.0, 4.0), "bulk": (20.0, 180.0)}),
            "fairness": _report({"light": (3.0, 50.0), "heavy": (1.0, 140.0)}),
        }
    )
    p = s["priority"]
    assert p["on_minus_alone_in_steps"] == pytest.approx(2.0)  # (0.18 - 0.10) / 0.04
    assert p["on_over_off"] == pytest.approx(0.015)
    assert p["bulk_kept"] == pytest.approx(0.85)
    assert s["fairness"]["heavy_over_light"] == pytest.approx(2.8)
    assert "knee" not in s and "batching" not in s  # only what was run
    md = to_markdown(s, {"date": "d", "cpu": "c"})
    assert "2.0 engine steps" in md and "heavy / light = 2.80" in md


def test_each_experiment_runs_on_its_server_with_workload_tenants_that_exist() -> None:
    plan = servers(None)
    by_run = {r.name: s for s in plan for r in s.runs}
    assert by_run["priority-off"].engine_env == {"LOOM_ENGINE_PRIORITY_SCHEDULING": "false"}
    static_env = by_run["batching-static"].engine_env
    assert static_env["LOOM_ENGINE_SCHEDULER_CLS"] == "loadtest.static_batching:StaticBatchingScheduler"
    assert by_run["priority-on"].engine_env == by_run["knee"].engine_env == {}
    for server in plan:
        for run in server.runs:
            names = {t.name for t in load_workload(WORKLOADS / run.workload).tenants}
            assert run.tenants is None or set(run.tenants) <= names
    assert {r.name for s in servers({"priority"}) for r in s.runs} == {
        "priority-chat-alone",
        "priority-bulk-alone",
        "priority-on",
        "priority-off",
    }


def test_the_static_server_env_loads_the_subclass_in_a_process_outside_the_checkout(tmp_path: Path) -> None:
    """What the replica of the static-batching server does: read its EngineConfig from the
    environment and import the benchmarks' scheduler from the checkout, its cwd elsewhere."""
    (static,) = [s for s in servers({"batching-static"})]
    code = (
        "from protocol.engine_config import EngineConfig; from worker.scheduler import scheduler_class; "
        "print(scheduler_class(EngineConfig().scheduler_cls).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | static.engine_env
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "StaticBatchingScheduler"
