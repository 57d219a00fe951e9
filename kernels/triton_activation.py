"""Triton SiLU-and-mul: ``silu(gate) * up`` for a fused ``[tokens, 2 * d]`` gate/up projection.

One program per (token, column tile); the math runs in fp32. ``silu(gate)`` is rounded to the input
dtype before the product, as the torch reference (two separate half-precision ops) does, so both
paths give the same numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast_to, interpreting, next_pow2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    d,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = cast_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRET).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, cast_to(act * up, dtype, INTERPRET), mask=ok)


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., 2 * d]`` -> ``[..., d]``; writes into ``out`` when given."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows == 0 or d == 0:
        return out
    block = min(next_pow2(d), 1024)
    grid = (rows, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](
        x2, out2, d, x2.stride(0), out2.stride(0), BLOCK=block, INTERPRET=interpreting(), num_warps=4
    )
    return out
