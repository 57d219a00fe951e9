"""Compiled CPU kernels: C++ sources under kernels/csrc, built on first use with the machine's compiler.

Built once per machine and source version (torch's extension cache, keyed by the sources and by the
instruction set the flags target), by whichever process gets there first; the others wait on its lock.
If no compiler is available the build fails once, is logged, and the torch reference runs instead.
``LOOM_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"]
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_module: ModuleType | None = None
_attempted = False


def enabled() -> bool:
    return os.environ.get("LOOM_CPU_KERNELS", "1") not in ("0", "false", "")


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled or unbuildable (then callers use the reference)."""
    global _module, _attempted
    if not enabled():
        return None
    if _attempted:
        return _module
    with _lock:
        if _attempted:
            return _module
        try:
            from torch.utils.cpp_extension import load

            isa = torch.backends.cpu.get_cpu_capability()
            started = time.monotonic()
            _module = load(
                name=f"loom_cpu_kernels_{isa.lower()}",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=["-O3", "-fopenmp", "-ffast-math", *_FLAGS.get(isa, [])],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            log.info("CPU kernels ready (%s, %.1f s)", isa, time.monotonic() - started)
        except Exception as exc:  # no compiler, no headers: the reference path still works
            log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
            _module = None
        _attempted = True
    return _module
