"""What machine a benchmark ran on: CPU model, count and the vector flags that change the results.

CPUs differ between machines of the same kind (AVX2 only, or AVX-512 with bf16), so every result
records these; figures are compared only within one run.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The flags that decide which kernels run fast (oneDNN, torch's CPU kernels, Loom's compiled kernel).
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
)


def cpu_info() -> dict[str, object]:
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_flags": [f for f in VECTOR_FLAGS if f in flags],
    }


def cpu_line() -> str:
    """One line for a Markdown report: ``AMD EPYC, 2 CPUs, flags avx2 avx512f ...``."""
    info = cpu_info()
    return f"{info['cpu_model']}, {info['cpus']} CPUs, flags {' '.join(info['cpu_flags']) or 'none of note'}"  # type: ignore[arg-type]
