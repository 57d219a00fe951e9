"""Helpers shared by the Triton kernels: interpreter detection and a store cast that rounds right.

The Triton interpreter (``TRITON_INTERPRET=1``, how CPU tests run the kernels) truncates when it
converts fp32 to bf16, where the GPU and torch round to nearest even. Kernels therefore compute in
fp32 and cast through :func:`cast_to`, which, only when interpreting, rounds bf16 by hand so that the
interpreter reproduces the reference bit for bit; on a GPU the branch is compiled away.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.settings import KernelSettings

# Triton picks interpreted or compiled kernels when ``@triton.jit`` decorates them, i.e. when the
# kernels.triton_* modules are imported; each imports this module first, so the value read here, once,
# is the one Triton used for them (and cast_to below). Kernel launches then check it for free.
_INTERPRETING: bool = KernelSettings().triton_interpret


def interpreting() -> bool:
    """True when the kernels run under the Triton interpreter (``TRITON_INTERPRET``)."""
    return _INTERPRETING


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


def num_programs_hint(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a nominal 8 off CUDA, where only the interpreter runs)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


@triton.jit
def cast_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """``x`` (fp32) as ``dtype``, rounding to nearest even also under the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)
