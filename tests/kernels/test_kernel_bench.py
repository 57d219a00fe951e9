"""The prepared GPU benchmark stays runnable without a GPU: its dry run (interpreter, tiny shapes)
checks and reports every kernel, and every kernel variant it launches compiles for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str, interpret: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "kernels.bench.run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dry_run_checks_every_kernel(tmp_path: Path) -> None:
    proc = run_bench("--dry-run", "--out", str(tmp_path), interpret=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    kernels = {r["kernel"] for r in results["rows"]}
    assert kernels >= {
        *("decode_attn", "prefill_attn", "kv_write", "rmsnorm+res", "rotary", "silu_and_mul"),
        *("lora_shrink", "lora_expand"),
    }
    assert {r["variant"].split("/")[0] for r in results["rows"] if r["kernel"] == "decode_attn"} == {
        "single",
        "split",
    }
    assert all(r["ok"] for r in results["rows"] if r["err"] is not None)
    assert results["failures"] == []
    table = (tmp_path / "results.md").read_text()
    assert "| kernel | model |" in table
    assert proc.stdout.rstrip().endswith("|"), "the short Markdown table must come last"


def test_every_variant_compiles_for_sm90() -> None:
    bin_dir = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists():
        pytest.skip("this Triton build ships no NVIDIA backend")
    proc = run_bench("--compile-only", "--quick", interpret=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "kernel variants compile for sm_90" in proc.stdout
