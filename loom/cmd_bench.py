"""``loom bench``, ``loom loadtest`` and ``loom soak``: launchers of the benchmarks in loadtest/.

The benchmarks are not part of the installed product (the wheel leaves loadtest/ out, with its
dependencies on the peer engines and plotting): these commands run ``python -m loadtest`` from the
source checkout this ``loom`` was installed from, and say so when there is none.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_COMMANDS = {
    "bench": "run a benchmark (results under loadtest/results/)",
    "loadtest": "open-loop multi-tenant load against a running Loom on this machine, with a report",
    "soak": "minutes of mixed load with faults injected, every token checked; or --fuzz N",
}


def checkout() -> Path | None:
    """The source tree beside this package, if it holds the benchmarks (an editable install)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "loadtest" / "cli.py").is_file() else None


LAUNCHED = frozenset(_COMMANDS)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Listed in ``loom --help``; ``loom.cli.main`` hands their arguments to :func:`launch` unparsed."""
    for name, help_text in _COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)


def launch(command: str, argv: list[str]) -> int:
    root = checkout()
    if root is None:
        print(
            f"loom {command}: the benchmarks live in Loom's source tree (loadtest/), which this "
            "installation does not have; run it from a checkout (make install)",
            file=sys.stderr,
        )
        return 2
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    # The benchmark takes this process's place: signals (Ctrl-C, SIGTERM) and the exit code are its own.
    os.execve(sys.executable, [sys.executable, "-m", "loadtest", command, *argv], env)
