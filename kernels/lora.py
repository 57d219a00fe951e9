"""Multi-LoRA over a flat batch: each token may use a different adapter, all in one step.

A LoRA adapter adds ``scale * (x @ A.T) @ B.T`` to a projection ``x @ W.T``. A replica keeps its
loaded adapters stacked in fixed slots, ``A [slots, rank, in]`` and ``B [slots, out, rank]`` (ranks
below the stack's are zero-padded), and a step says which slot each token uses (``-1``: none). The
work is two batched gathers, as Punica/S-LoRA and vLLM do:

* **shrink** ``h[t] = x[t] @ A[slot[t]].T``: ``[tokens, in] -> [tokens, rank]``;
* **expand** ``y[t] += scale[slot[t]] * h[t] @ B[slot[t]].T``: ``[tokens, rank] -> [tokens, out]``,
  added in place into ``y`` (which may be a column slice of a fused projection's output).

The references group tokens by slot (one GEMM per adapter present in the step); on CUDA the Triton
kernels read each token's slot and gather its adapter's rows directly; on CPU a compiled kernel
(kernels/csrc/lora_cpu.cpp) walks the tokens in slot order at each adapter's own rank, which avoids
the references' per-adapter op overhead when many adapters share a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from kernels.cpu_kernels import cpu_kernels
from kernels.dispatch import use_triton


@dataclass
class LoraBatch:
    """Which adapter slot each token of one step uses; built once per step, shared by every layer."""

    token_slots: torch.Tensor  # int32 [tokens] on the compute device; -1: the token uses no adapter
    ranks: torch.Tensor | None = None  # int32 [slots]: each slot's rank (rows past it are zero padding)
    # Host-side grouping for the references: the token indices of each slot present in the step.
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, long [n] indices)
    order: torch.Tensor | None = None  # long [tokens with an adapter], sorted by slot (compiled CPU path)

    @classmethod
    def build(
        cls, token_slots: list[int], ranks: list[int] | None = None, device: torch.device | str = "cpu"
    ) -> LoraBatch:
        slots = torch.tensor(token_slots, dtype=torch.int32)
        groups = []
        for s in sorted(set(token_slots) - {-1}):
            groups.append((s, torch.nonzero(slots == s).flatten().to(device)))
        order = torch.cat([idx for _, idx in groups]) if groups else torch.empty(0, dtype=torch.long)
        return cls(
            token_slots=slots.to(device),
            ranks=None if ranks is None else torch.tensor(ranks, dtype=torch.int32, device=device),
            groups=groups,
            order=order.to(device),
        )

    @property
    def active(self) -> bool:
        """Whether any token uses an adapter (a base-model-only step skips LoRA entirely)."""
        return bool(self.groups)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """``x [tokens, in]``, ``a [slots, rank, in]`` -> ``h [tokens, rank]`` (zeros for tokens without an
    adapter), in fp32."""
    if use_triton(x):
        from kernels.triton_lora import lora_shrink_triton

        return lora_shrink_triton(x, a, batch.token_slots)
    if (compiled := _compiled_cpu(x, a)) is not None and x.stride(-1) == 1:
        h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32)
        compiled.lora_shrink(x, a, batch.token_slots, batch.order, _ranks(batch, a.shape), h)
        return h
    return lora_shrink_ref(x, a, batch)


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, batch: LoraBatch
) -> torch.Tensor:
    """``y [tokens, out] += scales[slot] * h @ b[slot].T`` for each token with an adapter; returns ``y``.

    ``h [tokens, rank]`` (fp32), ``b [slots, out, rank]``, ``scales`` fp32 ``[slots]``; ``y`` may be a
    non-contiguous column slice (its row stride is honoured).
    """
    if use_triton(y):
        from kernels.triton_lora import lora_expand_triton

        return lora_expand_triton(y, h, b, scales, batch.token_slots)
    if (compiled := _compiled_cpu(y, b)) is not None and y.stride(-1) == 1 and h.is_contiguous():
        ranks = _ranks(batch, (b.shape[0], b.shape[2]))
        compiled.lora_expand(y, h, b, scales, batch.token_slots, batch.order, ranks)
        return y
    return lora_expand_ref(y, h, b, scales, batch)


def _ranks(batch: LoraBatch, slots_rank: tuple[int, ...]) -> torch.Tensor:
    """Each slot's rank: the batch's, or the stack's padded rank when the caller gave none."""
    if batch.ranks is not None:
        return batch.ranks
    return torch.full((slots_rank[0],), slots_rank[1], dtype=torch.int32)


def _compiled_cpu(act: torch.Tensor, weights: torch.Tensor) -> ModuleType | None:
    """The compiled CPU kernels when they apply: fp32 on the CPU, contiguous weight stacks."""
    if act.device.type != "cpu" or act.dtype != torch.float32 or weights.dtype != torch.float32:
        return None
    return cpu_kernels() if weights.is_contiguous() else None


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, idx in batch.groups:
        r = _rank(batch, slot, a.shape[1])
        h[idx, :r] = x[idx].float() @ a[slot, :r].float().t()
    return h


def lora_expand_ref(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, batch: LoraBatch
) -> torch.Tensor:
    for slot, idx in batch.groups:
        r = _rank(batch, slot, b.shape[2])
        delta = (h[idx, :r] @ b[slot, :, :r].float().t()) * scales[slot]
        y[idx] = (y[idx].float() + delta).to(y.dtype)
    return y


def _rank(batch: LoraBatch, slot: int, padded: int) -> int:
    return int(batch.ranks[slot]) if batch.ranks is not None else padded
