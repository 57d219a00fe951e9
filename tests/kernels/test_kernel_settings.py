"""Kernel settings and module boundaries: one reader of the environment, no reference <-> Triton cycle.

``kernels.settings.KernelSettings`` is the only place ``kernels/`` reads environment variables; the
attention dispatch and its reference must import without Triton (they run on CPU-only callers, and
the Triton module imports the metadata, so a reverse import would be a cycle).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import force_triton
from kernels.dispatch import triton_forced
from kernels.settings import KernelSettings

ROOT = Path(__file__).resolve().parents[2]
VARIABLES = ("LOOM_FORCE_TRITON", "LOOM_CPU_KERNELS", "TRITON_INTERPRET")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    s = KernelSettings()
    assert (s.force_triton, s.cpu_kernels, s.triton_interpret) == (False, True, False)


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("", False),
        ("0", False),
        ("false", False),
        ("False", False),
        ("off", False),
        ("1", True),
        ("true", True),
    ],
)
def test_loom_switches(clean_env: pytest.MonkeyPatch, value: str, on: bool) -> None:
    clean_env.setenv("LOOM_FORCE_TRITON", value)
    clean_env.setenv("LOOM_CPU_KERNELS", value)
    s = KernelSettings()
    assert (s.force_triton, s.cpu_kernels) == (on, on)


@pytest.mark.parametrize(
    ("value", "on"), [("", False), ("0", False), ("false", False), ("2", False), ("1", True), ("True", True)]
)
def test_triton_interpret_parsed_like_triton(clean_env: pytest.MonkeyPatch, value: str, on: bool) -> None:
    clean_env.setenv("TRITON_INTERPRET", value)
    assert KernelSettings().triton_interpret is on


def test_constructor_arguments_override_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("LOOM_CPU_KERNELS", "1")
    assert KernelSettings(cpu_kernels=False).cpu_kernels is False
    assert KernelSettings(LOOM_FORCE_TRITON="1").force_triton is True


def test_force_triton_context_manager() -> None:
    before = triton_forced()
    with force_triton():
        assert triton_forced()
        with force_triton(False):
            assert not triton_forced()
        assert triton_forced()
    assert triton_forced() is before


def test_settings_class_is_the_only_environment_reader() -> None:
    """Outside kernels/settings.py only the benchmark script touches os.environ, and not to read a switch."""
    allowed = {
        'os.environ.get("OUT")',  # the benchmark's --out default (a command-line script's own option)
        'os.environ["TRITON_INTERPRET"] = "1"',  # the benchmark's --dry-run sets it before importing Triton
    }
    offenders = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "kernels":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv|environ\[", line) and not any(a in line for a in allowed):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []


def run_python(code: str, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_attention_and_reference_import_without_triton_module() -> None:
    result = run_python(
        "import json, sys\n"
        "import kernels, kernels.attention, kernels.attention_ref, kernels.attention_metadata\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('kernels.triton'))))",
        LOOM_FORCE_TRITON="1",
    )
    assert result == []


@pytest.mark.parametrize(("value", "forced"), [("0", False), ("false", False), ("", False), ("1", True)])
def test_force_triton_read_at_import(value: str, forced: bool) -> None:
    result = run_python(
        "import json\nfrom kernels.dispatch import triton_forced\nprint(json.dumps(triton_forced()))",
        LOOM_FORCE_TRITON=value,
    )
    assert result is forced


def test_cpu_kernels_off() -> None:
    result = run_python(
        "import json\nfrom kernels.cpu_kernels import cpu_kernels\nprint(json.dumps(cpu_kernels() is None))",
        LOOM_CPU_KERNELS="0",
    )
    assert result is True
