"""Compiled CPU kernels: C++ sources under kernels/csrc, built on first use with the machine's compiler.

Built once per machine and source version (torch's extension cache, keyed by the sources and by the
instruction set the flags target), by whichever process gets there first; the others wait on its lock.
If no compiler is available the build fails once, is logged, and the torch reference runs instead.
``LOOM_CPU_KERNELS=0`` turns them off (read once, on the first call; see kernels/settings.py).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels.settings import KernelSettings

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention_cpu.cpp",
        "kv_write_cpu.cpp",
        "lora_cpu.cpp",
        "layer_ops_cpu.cpp",
        "dense_cpu.cpp",
        "argmax_cpu.cpp",
        "bindings.cpp",
    )
]
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_module: ModuleType | None = None
_attempted = False


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled or unbuildable (then callers use the reference).

    Called on every CPU attention call, so the setting and the build are looked at once, then the
    answer is remembered for the life of the process.
    """
    global _module, _attempted
    if _attempted:
        return _module
    with _lock:
        if _attempted:
            return _module
        _module = _build() if KernelSettings().cpu_kernels else None
        _attempted = True
    return _module


def cpu_kernels_for(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled module when the tensors are on CPU and all fp32 or all bf16 (what the C++ layer
    ops take), else None."""
    dtypes = {t.dtype for t in tensors}
    if all(t.device.type == "cpu" for t in tensors) and (
        dtypes == {torch.float32} or dtypes == {torch.bfloat16}
    ):
        return cpu_kernels()
    return None


def _build() -> ModuleType | None:
    """Compile (or load from torch's extension cache) the module; None, logged, if that fails."""
    try:
        from torch.utils.cpp_extension import load

        isa = torch.backends.cpu.get_cpu_capability()
        started = time.monotonic()
        module: ModuleType = load(
            name=f"loom_cpu_kernels_{isa.lower()}",
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-fopenmp", "-ffast-math", *_FLAGS.get(isa, [])],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        log.info("CPU kernels ready (%s, %.1f s)", isa, time.monotonic() - started)
        return module
    except Exception as exc:  # no compiler, no headers: the reference path still works
        log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None
