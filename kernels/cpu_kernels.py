"""Compiled CPU kernels: C++ sources under kernels/csrc, built on first use with the machine's compiler.

Built once per install and source version, by whichever process gets there first (the others wait
on its lock): the module's name carries a digest of the sources, the flags, the instruction set
and the torch version, and it is built inside the virtual environment (``<prefix>/share/loom/
kernels``), so two checkouts or an upgrade never rebuild over each other at every switch, as
torch's one user-wide cache entry per name did (seen: a replica's readiness taking 3 min 20 s).
``make install`` builds it, so no engine replica compiles at start. With ``TORCH_EXTENSIONS_DIR``
set, or a prefix that is not writable, torch's extension cache is used (still keyed by the digest).
If no compiler is available the build fails once, is logged, and the torch reference runs instead.
``LOOM_CPU_KERNELS=0`` turns them off (read once, on the first call; see kernels/settings.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
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
        "token_mask_cpu.cpp",
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


def module_name(isa: str, cflags: list[str], sources: list[Path] = _SOURCES) -> str:
    """The extension's name: what it is built from, digested, so a different build never shares a
    name (and so a cache entry) with this one."""
    digest = hashlib.sha256()
    for part in (torch.__version__, isa, *cflags):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return f"loom_cpu_kernels_{isa.lower()}_{digest.hexdigest()[:16]}"


def build_directory(name: str, prefix: str = sys.prefix) -> Path | None:
    """Where the extension is built: inside the virtual environment, or None for torch's own cache
    (``TORCH_EXTENSIONS_DIR`` chosen by the user, or a prefix this process cannot write)."""
    if KernelSettings().torch_extensions_dir:
        return None
    path = Path(prefix) / "share" / "loom" / "kernels" / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def _build() -> ModuleType | None:
    """Compile (or load from torch's extension cache) the module; None, logged, if that fails."""
    try:
        from torch.utils.cpp_extension import load

        isa = torch.backends.cpu.get_cpu_capability()
        cflags = ["-O3", "-fopenmp", "-ffast-math", *_FLAGS.get(isa, [])]
        name = module_name(isa, cflags)
        build_dir = build_directory(name)
        started = time.monotonic()
        module: ModuleType = load(
            name=name,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=None if build_dir is None else str(build_dir),
            verbose=False,
        )
        log.info(
            "CPU kernels ready (%s, %s, %.1f s)",
            name,
            build_dir or "torch's cache",
            time.monotonic() - started,
        )
        return module
    except Exception as exc:  # no compiler, no headers: the reference path still works
        log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None
