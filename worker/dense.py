"""Dense projections ``y = x @ W.T (+ b)``, with weights packed once for a faster CPU GEMM.

fp32 on AVX-512 and AVX2 CPUs: Loom's compiled kernel (kernels/dense.py), which reads the weights
closer to the copy bandwidth than oneDNN at decode batch sizes (docs/adr/0003, addenda 2 and 3).
Elsewhere (bf16, or a build without the kernel): oneDNN's prepacked linear, as follows.

A plain fp32 GEMM re-packs the weight on every call; at decode batch sizes (8-128 rows) that costs
as much as the math. Reordering each weight once into oneDNN's blocked layout made the projections
1.2-1.7x faster on the 2-core development machine (measured in loadtest/results/engine.md's run).
The packed weight is faster at every row count measured, single rows included (the lm_head at 1-7
rows: 1.2-4.5 ms packed against 6.4-25.7 ms plain, loadtest/results/calibration.md), so it serves every
call and the plain copy is dropped. Where oneDNN is missing or disagrees with the plain GEMM, the plain
weight is kept and used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import silu_and_mul
from kernels.dense import (
    GatedWeight,
    PackedWeight,
    gated_linear,
    pack_gated_weight,
    pack_weight,
    packed_linear,
)

log = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64  # rows the blocked layout is tuned for; any row count works


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 always; bf16 where the CPU computes it natively (AVX512-BF16 or AMX), else it is emulated
    and slower than fp32."""
    if dtype == torch.bfloat16:
        bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if bf16 is None or not bf16():
            return False
    elif dtype != torch.float32:
        return False
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _agrees(
    linear: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether a packed path gives the plain GEMM's answer on a probe (a broken build must not serve)."""
    probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
    want = F.linear(probe, weight, bias)
    got = linear(probe)
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16 rounds its output
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


class Dense:
    """A projection; with ``gated``, a gated MLP's ``[gate; up]`` projection, which can also hand back
    its activation ``silu(gate) * up`` (:meth:`silu_mul`), fused into the GEMM where the compiled
    kernel serves it."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        prepack: bool = True,
        gated: bool = False,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self._weight: torch.Tensor | None = weight
        self._packed: torch.Tensor | None = None
        self._panels: PackedWeight | None = None
        self._gated: GatedWeight | None = None
        if prepack and gated and bias is None and (paired := pack_gated_weight(weight)) is not None:
            if _agrees(lambda x: gated_linear(x, paired, split=True), weight, bias):
                self._gated = paired
                self._weight = None
                return
            log.warning("the compiled gated kernel disagrees with the plain GEMM; not using it")
        if prepack and (panels := pack_weight(weight)) is not None:
            if _agrees(lambda x: packed_linear(x, panels, bias), weight, bias):
                self._panels = panels
                self._weight = None
                return
            log.warning("the compiled dense kernel disagrees with the plain GEMM; not using it")
        if prepack and _onednn_usable(weight.device, weight.dtype):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
                onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: E731
                if _agrees(onednn, weight, bias):
                    self._packed = packed
                    self._weight = None  # one copy of the weights, not two
                else:
                    log.warning("oneDNN linear disagrees with the plain GEMM; using the plain path")
            except RuntimeError as exc:  # an op missing from this torch build
                log.info("oneDNN prepacking unavailable (%s); using the plain GEMM", exc)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a gated projection: one pass where the kernel fuses it."""
        if self._gated is not None:
            return gated_linear(x, self._gated)
        return silu_and_mul(self(x))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._gated is not None:
            return gated_linear(x, self._gated, split=True)
        if self._panels is not None:
            return packed_linear(x, self._panels, self.bias)
        if self._packed is not None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self._packed, self.bias, "none", [], ""
            )
            return y
        assert self._weight is not None
        return F.linear(x, self._weight, self.bias)
