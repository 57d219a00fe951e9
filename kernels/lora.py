"""Multi-LoRA over a flat batch: each token may use a different adapter, all in one step.

A LoRA adapter adds ``scale * (x @ A.T) @ B.T`` to a projection ``x @ W.T``. A replica keeps its
loaded adapters stacked in fixed slots, ``A [slots, rank, in]`` and ``B [slots, out, rank]`` (ranks
below the stack's are zero-padded), and a step says which slot each token uses (``-1``: none). The
work is two batched gathers, as Punica/S-LoRA and vLLM do:

* **shrink** ``h[t] = x[t] @ A[slot[t]].T``: ``[tokens, in] -> [tokens, rank]``;
* **expand** ``y[t] += scale[slot[t]] * h[t] @ B[slot[t]].T``: ``[tokens, rank] -> [tokens, out]``,
  added in place into ``y`` (which may be a column slice of a fused projection's output).

The references group tokens by slot (one GEMM per adapter present in the step), which is what a CPU
does best; the Triton kernels read each token's slot and gather its adapter's rows directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.dispatch import use_triton


@dataclass
class LoraBatch:
    """Which adapter slot each token of one step uses; built once per step, shared by every layer."""

    token_slots: torch.Tensor  # int32 [tokens] on the compute device; -1: the token uses no adapter
    # Host-side grouping for the references: the token indices of each slot present in the step.
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, long [n] indices)

    @classmethod
    def build(cls, token_slots: list[int], device: torch.device | str = "cpu") -> LoraBatch:
        slots = torch.tensor(token_slots, dtype=torch.int32)
        groups = []
        for s in sorted(set(token_slots) - {-1}):
            groups.append((s, torch.nonzero(slots == s).flatten().to(device)))
        return cls(token_slots=slots.to(device), groups=groups)

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
    return lora_expand_ref(y, h, b, scales, batch)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    h = torch.zeros((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, idx in batch.groups:
        h[idx] = x[idx].float() @ a[slot].float().t()
    return h


def lora_expand_ref(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, batch: LoraBatch
) -> torch.Tensor:
    for slot, idx in batch.groups:
        delta = (h[idx] @ b[slot].float().t()) * scales[slot]
        y[idx] = (y[idx].float() + delta).to(y.dtype)
    return y
