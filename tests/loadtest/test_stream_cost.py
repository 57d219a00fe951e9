"""``loom bench stream-cost``'s accounting: CPU read per thread from /proc, grouped by process role,
a replica split into its engine loop and the rest, divided by the tokens streamed."""

from __future__ import annotations

import os
import threading
import time

import pytest

from loadtest.bench_stream_cost import (
    ENGINE_THREAD,
    cpu_by_group,
    per_token,
    threads_of,
    to_markdown,
    workload,
)
from worker.async_engine import name_os_thread


def test_groups_split_a_replica_by_its_engine_thread_and_count_only_the_window() -> None:
    before = {
        (1, 1): ("gateway", "loom", 2.0),
        (5, 5): ("replica", "ray::Serve", 1.0),
        (5, 6): ("replica", ENGINE_THREAD, 10.0),
    }
    after = {
        (1, 1): ("gateway", "loom", 2.5),
        (5, 5): ("replica", "ray::Serve", 1.2),
        (5, 6): ("replica", ENGINE_THREAD, 14.0),
        (5, 7): ("replica", ENGINE_THREAD, 1.0),  # an OpenMP worker started in the window
        (9, 9): ("serve_controller", "ray::ServeCont", 0.1),
    }
    groups = cpu_by_group(before, after)
    assert groups == {
        "gateway": 0.5,
        "replica_rest": pytest.approx(0.2),
        "replica_engine_thread": 5.0,
        "serve_controller": 0.1,
    }
    rows = per_token(groups, tokens=1000)
    assert rows["gateway"]["ms_per_output_token"] == 0.5


def test_a_named_thread_is_seen_by_that_name_with_its_cpu() -> None:
    spent = threading.Event()

    def burn() -> None:
        name_os_thread(ENGINE_THREAD)
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spent.wait(5)

    t = threading.Thread(target=burn)
    t.start()
    time.sleep(0.5)
    mine = [th for th in threads_of(os.getpid()) if th.name == ENGINE_THREAD]
    spent.set()
    t.join()
    assert len(mine) == 1 and mine[0].cpu_s >= 0.1


def test_the_workload_is_seeded_and_the_report_renders() -> None:
    assert workload(8, 3) == workload(8, 3) != workload(8, 4)
    assert all(4 <= m <= 96 for _, m in workload(200, 0))
    report = {
        "date": "d",
        "machine": "m",
        "workload": {"requests": 2, "front": "HTTP", "engine": "e"},
        "output_tokens": 100,
        "wall_s": 1.0,
        "output_tokens_per_s": 100.0,
        "ttft_p50_s": 0.1,
        "cpu": per_token({"gateway": 0.05, "replica_rest": 0.02}, 100),
        "replica_threads": [{"name": ENGINE_THREAD, "cpu_s": 1.0}],
        "targets_ms_per_token": {"gateway": 0.15, "replica_rest": 0.1},
    }
    md = to_markdown(report)
    assert "| gateway | 0.05 | 0.5 | <= 0.15 |" in md and "loom-engine 1.0 s." in md
