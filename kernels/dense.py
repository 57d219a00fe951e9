"""fp32 projections from weights packed once for the compiled kernel (csrc/dense_cpu.cpp).

The decode step's projections stream their weights at 1-64 rows; the compiled kernel reads them
closer to the copy bandwidth than oneDNN's prepacked linear (docs/adr/0003, addenda 2 and 3). It
exists in the AVX-512 and AVX2 builds (panels of 32 and 16 columns), and only for fp32: in bf16,
oneDNN's AVX512-BF16/AMX path stays.

A gated MLP's gate and up projections can be packed in pairs instead (``pack_gated_weight``): each
panel then holds some gate columns and the same up columns, and the kernel hands back
``silu(gate) * up`` directly (``gated_linear``), never writing the two products out in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kernels.cpu_kernels import cpu_kernels

_NO_BIAS = torch.empty(0)


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` in the kernel's panels (zero padded)."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    module: ModuleType


def _kernel_for(weight: torch.Tensor) -> ModuleType | None:
    """The compiled module where it can serve ``weight``: a 2-d fp32 CPU tensor, on an AVX-512 or
    AVX2 build, kernels neither disabled nor unbuildable."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    module = cpu_kernels()
    return module if module is not None and module.dense_available() else None


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """The packed weight, or None where the compiled kernel cannot serve it: the caller keeps its own
    path then."""
    if (module := _kernel_for(weight)) is None:
        return None
    out_features, in_features = weight.shape
    return PackedWeight(module.dense_pack(weight.contiguous()), out_features, in_features, module)


@dataclass(frozen=True)
class GatedWeight:
    """A gated MLP's ``[gate; up]`` weight ``[2 * intermediate, in_features]`` in paired panels."""

    panels: torch.Tensor
    intermediate: int
    in_features: int
    module: ModuleType


def pack_gated_weight(weight: torch.Tensor) -> GatedWeight | None:
    """The paired packing of ``[gate; up]``, or None where the kernel cannot serve it (as
    :func:`pack_weight`, or an intermediate size that is not a multiple of the ISA's vector)."""
    if (module := _kernel_for(weight)) is None:
        return None
    rows, in_features = weight.shape
    if rows % 2 or (rows // 2) % module.dense_gate_width():
        return None
    return GatedWeight(module.dense_pack_gated(weight.contiguous()), rows // 2, in_features, module)


def gated_linear(x: torch.Tensor, weight: GatedWeight, split: bool = False) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` ``[..., intermediate]``; with ``split``, the product
    ``[..., 2 * intermediate]`` (gate columns, then up), as a plain projection would give it."""
    rows = _rows(x, weight.in_features)
    width = weight.intermediate * (2 if split else 1)
    out = torch.empty(rows.shape[0], width, dtype=torch.float32)
    weight.module.dense_gated_cpu(rows, weight.panels, out, split)
    return out.view(*x.shape[:-1], width)


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``x`` of shape ``[..., in_features]``, fp32."""
    rows = _rows(x, weight.in_features)
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    weight.module.dense_cpu(rows, weight.panels, _NO_BIAS if bias is None else bias.contiguous(), out)
    return out.view(*x.shape[:-1], weight.out_features)


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x [..., in_features]`` as the contiguous fp32 ``[rows, in_features]`` the kernel reads."""
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {in_features}")
    return x.reshape(-1, in_features).to(torch.float32).contiguous()
