"""Chooses, per call, between the Triton kernel and its torch reference twin.

Triton runs on CUDA tensors. On CPU the torch reference runs, unless the Triton path is forced
(``LOOM_FORCE_TRITON=1`` or :func:`force_triton`), which is how CPU tests drive the kernels through
the Triton interpreter (``TRITON_INTERPRET=1`` must be set before Triton is first imported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kernels.settings import KernelSettings

# Read once, at import; force_triton() overrides it in process.
_forced: bool = KernelSettings().force_triton


def triton_forced() -> bool:
    """Whether the Triton path is forced right now (environment or :func:`force_triton`)."""
    return _forced


def use_triton(x: torch.Tensor) -> bool:
    """True when the Triton kernel should run for an op whose main input is ``x``."""
    return _forced or x.is_cuda


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Force (or forbid) the Triton path inside the block, whatever the tensors' device."""
    global _forced
    previous = _forced
    _forced = enabled
    try:
        yield
    finally:
        _forced = previous
