"""`loom bench`, `loom loadtest` and `loom soak` run the benchmarks of the source checkout (they are not
part of the installed product), and say so plainly where there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loom import cmd_bench

LOOM = str(Path(sys.executable).with_name("loom"))


@pytest.mark.parametrize("command", ["bench", "loadtest", "soak"])
def test_launched_from_the_checkout_with_its_own_arguments(command: str, tmp_path: Path) -> None:
    # From another directory: the launcher finds the checkout itself, and the benchmark parses --help.
    out = subprocess.run([LOOM, command, "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"usage: loom {command}" in out.stdout


def test_without_a_checkout_it_says_where_the_benchmarks_are(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cmd_bench, "checkout", lambda: None)
    assert cmd_bench.launch("bench", ["engine"]) == 2
    assert "source tree (loadtest/)" in capsys.readouterr().err
