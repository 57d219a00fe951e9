"""The compiled CPU multi-LoRA kernels (kernels/csrc/lora_cpu.cpp) vs the torch reference vs float64.

On CPU fp32 tensors ``lora_shrink`` / ``lora_expand`` run the compiled kernels. Slots hold adapters of
different ranks, zero-padded to the stack's; the padding holds NaN here, so reading past a slot's
rank (the kernel must stop at it) poisons the result. Tokens without an adapter and columns outside
the slice ``y`` is must stay untouched bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import rel_err

from kernels.cpu_kernels import cpu_kernels
from kernels.lora import LoraBatch, lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    assert cpu_kernels() is not None, "the CPU kernels did not build on this machine"


def _stack(slots: int, rows: int, cols: int, ranks: list[int], rank_dim: int, seed: int) -> torch.Tensor:
    """Random weights with each slot's rank-dim padding set to NaN (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((slots, rows, cols), generator=g)
    for s, r in enumerate(ranks):
        if rank_dim == 1:
            w[s, r:] = float("nan")
        else:
            w[s, :, r:] = float("nan")
    return w


@pytest.mark.parametrize("token_slots", [[2, -1, 0, 2, 1, -1, 0, 2, 2], [1], [-1, -1], [0] * 17])
def test_shrink_and_expand_match_float64(token_slots: list[int]) -> None:
    ranks, max_rank, d_in, d_out = [4, 16, 9], 16, 48, 40
    a = _stack(3, max_rank, d_in, ranks, 1, 1)
    b = _stack(3, d_out, max_rank, ranks, 2, 2)
    scales = torch.tensor([0.5, 2.0, 1.25])
    x = torch.randn(len(token_slots), d_in + 8)[:, 4 : 4 + d_in]  # a column slice: row stride != width
    batch = LoraBatch.build(token_slots, ranks)
    h = lora_shrink(x, a, batch)
    wide = torch.randn(len(token_slots), d_out + 20)
    before = wide.clone()
    y = lora_expand(wide[:, 7 : 7 + d_out], h, b, scales, batch)
    # float64 from the clean (rank-sliced) weights, token by token
    want_h = torch.zeros(len(token_slots), max_rank, dtype=torch.float64)
    want_y = before[:, 7 : 7 + d_out].double().clone()
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        r = ranks[s]
        want_h[t, :r] = a[s, :r].double() @ x[t].double()
        want_y[t] += scales[s].double() * (b[s, :, :r].double() @ want_h[t, :r])
    assert torch.isfinite(h).all() and torch.isfinite(y).all()
    assert rel_err(h, want_h) < 1e-5
    assert rel_err(y, want_y) < 1e-5
    assert rel_err(lora_shrink_ref(x, a, batch), want_h) < 1e-5  # the reference stops at each rank too
    untouched = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(wide[untouched], before[untouched])
    assert torch.equal(wide[:, :7], before[:, :7]) and torch.equal(
        wide[:, 7 + d_out :], before[:, 7 + d_out :]
    )


def test_compiled_path_agrees_with_the_reference_on_clean_weights() -> None:
    token_slots = [1, 0, -1, 1, 1, 0]
    a, b = torch.randn(2, 8, 32), torch.randn(2, 24, 8)
    a[0, 5:] = 0.0  # slot 0 holds a rank-5 adapter (zero padding, as a replica's slot table has)
    b[0, :, 5:] = 0.0
    scales = torch.tensor([1.5, 0.25])
    x = torch.randn(6, 32)
    batch = LoraBatch.build(token_slots, [5, 8])
    h = lora_shrink(x, a, batch)
    assert rel_err(h, lora_shrink_ref(x, a, batch)) < 1e-6
    y0 = torch.randn(6, 24)
    got = lora_expand(y0.clone(), h, b, scales, batch)
    assert rel_err(got, lora_expand_ref(y0.clone(), h, b, scales, batch)) < 1e-6
