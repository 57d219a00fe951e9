"""py-spy's collapsed stacks read back: self time at the top of each stack, libraries counted once
per sample however many of their frames it passed through."""

from __future__ import annotations

from pathlib import Path

from loadtest.profiles import summarise


def test_self_and_library_shares_of_collapsed_stacks(tmp_path: Path) -> None:
    stacks = tmp_path / "gateway.collapsed.txt"
    stacks.write_text(
        "thread (1): MainThread;run (asyncio/base_events.py:10);write (asyncio/selector_events.py:3) 6\n"
        "thread (1): MainThread;run (asyncio/base_events.py:10);_dispatch (gateway/request_path.py:400);"
        "inc (prometheus_client/metrics.py:9) 3\n"
        "thread (2): router;_route (ray/serve/_private/router.py:1) 1\n"
        "not a stack line\n"
    )
    summary = summarise(stacks, top=2)
    assert summary.samples == 10
    assert summary.top_self == [
        ("write (asyncio/selector_events.py)", 0.6),
        ("inc (prometheus_client/metrics.py)", 0.3),
    ]
    shares = dict(summary.by_library)
    assert shares["asyncio"] == 0.9 and shares["loom gateway"] == 0.3 and shares["ray.serve"] == 0.1
    assert "ray core" not in shares  # ray/serve/ frames count under ray.serve only


def test_an_empty_recording_summarises_to_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "replica.collapsed.txt"
    empty.write_text("")
    assert summarise(empty).samples == 0
