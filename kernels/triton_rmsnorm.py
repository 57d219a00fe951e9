"""Triton RMSNorm, optionally fused with the residual add before it (one read of each row).

One program per row with the whole hidden dimension in one tile (hidden sizes up to a few
thousand fit in registers), fp32 statistics. The rounding steps follow the reference exactly:
``x + residual`` is rounded to the input dtype (that is the new residual, and what is normalized),
and the normalized row is rounded to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cast_to, interpreting, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    hidden,
    eps,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    in_dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        s = cast_to(x + r, in_dtype, INTERPRET)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=ok)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = cast_to(x * rstd, in_dtype, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, cast_to(normed * w, out_ptr.dtype.element_ty, INTERPRET), mask=ok
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.rmsnorm.rms_norm_ref`; ``out``/``residual_out`` are optional
    destinations (fresh tensors otherwise; the inputs are never modified)."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out2 = residual_out.view(-1, hidden)
    else:
        res2 = res_out2 = x2  # never read or written: HAS_RESIDUAL is False
    weight = weight.contiguous()
    rows = x2.shape[0]
    if rows:
        block = next_pow2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out2,
            res_out2,
            hidden,
            float(eps),
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            res_out2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            INTERPRET=interpreting(),
            num_warps=min(max(block // 256, 1), 16),
        )
    if residual is None:
        return out
    assert residual_out is not None
    return out, residual_out
