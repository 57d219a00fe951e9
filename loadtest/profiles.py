"""Sampling profiles of served processes (py-spy), summarised where the CPU went.

``py-spy record`` attaches to a running process without restarting it and samples its Python stacks;
only threads that are running are sampled (no ``--idle``), so the counts are CPU, not wall time.
The raw collapsed stacks are committed beside a report, and :func:`summarise` reads them back: the
functions with the most samples at the top of the stack (self), and the share under each library
(inclusive: a sample counts once per library it passed through).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RATE_HZ = 100

# Where a frame's file lies -> the library it is counted under (first match wins).
LIBRARIES = (
    ("ray/serve/", "ray.serve"),
    ("ray/", "ray core"),
    ("asyncio/", "asyncio"),
    ("uvicorn/", "uvicorn"),
    ("starlette/", "starlette"),
    ("fastapi/", "fastapi"),
    ("pydantic", "pydantic"),
    ("prometheus_client/", "prometheus_client"),
    ("grpc/", "grpc"),
    ("json/", "json"),
    ("gateway/", "loom gateway"),
    ("tenancy/", "loom tenancy"),
    ("serving/", "loom serving"),
    ("protocol/", "loom protocol"),
    ("worker/", "loom worker"),
    ("torch/", "torch"),
)


def py_spy() -> str | None:
    """The py-spy beside this interpreter (the dev install has it), or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass
class Recording:
    name: str
    pid: int
    path: Path
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def recording(targets: dict[str, int], out_dir: Path) -> Iterator[dict[str, Path]]:
    """Sample each ``name -> pid`` while the block runs; yields ``name -> collapsed stacks file``
    (written when the block ends). Without py-spy, or where attaching is refused, a target has no
    file: the caller reports what it got."""
    exe = py_spy()
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    running: list[Recording] = []
    if exe is not None:
        for name, pid in targets.items():
            path = out_dir / f"{name}.collapsed.txt"
            argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(path)]
            argv += ["--rate", str(RATE_HZ), "--nonblocking", "--threads"]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            running.append(Recording(name, pid, path, proc))
    try:
        yield files
    finally:
        for r in running:
            r.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for r in running:
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
            if r.path.exists() and r.path.stat().st_size > 0:
                files[r.name] = r.path


def library_of(frame: str) -> str | None:
    for marker, library in LIBRARIES:
        if marker in frame:
            return library
    return None


@dataclass(frozen=True)
class Summary:
    samples: int
    top_self: list[tuple[str, float]]  # function (file:line stripped to file), share of samples
    by_library: list[tuple[str, float]]  # library, share of samples passing through it


def _function(frame: str) -> str:
    """``name (path/to/file.py:12)`` -> ``name (file.py)``: lines of one function add up."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(file.split('/')[-2:])})"


def summarise(path: Path, top: int = 15) -> Summary:
    """Read py-spy's collapsed stacks (``frame;frame;... count`` per line, root first)."""
    self_counts: Counter[str] = Counter()
    library_counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f.strip() and not f.startswith("thread (")]
        if not frames:
            continue
        total += count
        self_counts[_function(frames[-1])] += count
        for library in {lib for f in frames if (lib := library_of(f)) is not None}:
            library_counts[library] += count
    if total == 0:
        return Summary(0, [], [])
    return Summary(
        total,
        [(f, round(c / total, 4)) for f, c in self_counts.most_common(top)],
        [(lib, round(c / total, 4)) for lib, c in library_counts.most_common()],
    )
