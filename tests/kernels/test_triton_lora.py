"""Multi-LoRA shrink and expand: Triton vs the torch references vs an independent float64 einsum.

Every case mixes adapters in one batch, with some tokens on no adapter (slot -1) and one loaded slot
nobody uses. Values the ops must ignore are NaN (x and h rows of slot -1 tokens, the unused slot's
weights), so reading them shows up. Shrink writes fresh buffers, which are NaN-poisoned (partials
too); expand adds in place into a column slice of a wider tensor whose other columns, and the rows
of slot -1 tokens, must come out bit for bit unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from triton_test_utils import DEVICE, DTYPES, poisoned, randn, rel_err, tol

import kernels.triton_lora as triton_lora
from kernels import force_triton
from kernels.lora import LoraBatch, lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
from kernels.triton_lora import lora_expand_triton, lora_shrink_triton

NUM_SLOTS = 4
UNUSED = 1  # loaded, but no token in any case uses it: its weights are NaN

# (tokens' slots, in, out, rank, tile overrides): decode-like mixes, a prefill-like run of one slot
# across two token tiles, uneven K splits, padded ranks, a batch with no adapter at all.
CASES = {
    "decode": ([2, 0, -1, 3, 2, -1, 0], 96, 80, 8, {}),
    "one": ([3], 48, 16, 4, {}),
    "run+mixed": ([0] * 13 + [-1, 2, -1, 3, 0, 0, 2], 80, 96, 16, {"block_m": 16}),
    "odd_rank": ([-1, 3, 3, 0, 2], 64, 40, 12, {}),
    "no_adapter": ([-1, -1, -1], 32, 24, 4, {}),
}


def slot_batch(slots: list[int]) -> LoraBatch:
    assert UNUSED not in slots
    return LoraBatch.build(slots, device=DEVICE)


def weights(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Stacked adapter weights ``[NUM_SLOTS, ...]`` with NaN in the unused slot."""
    w = randn(gen, NUM_SLOTS, *shape, dtype=dtype)
    w[UNUSED] = float("nan")
    return w


def with_nan_rows(t: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``t`` with NaN in the rows of tokens without an adapter (the ops must not read them)."""
    dead = torch.tensor([s < 0 for s in slots], device=t.device)
    t[dead] = float("nan")
    return t


def gathered(w: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Each token's adapter weights in float64 (slot 0's for tokens without one; masked later)."""
    idx = torch.tensor(slots).clamp_min(0)
    return w.double().cpu()[idx]


def live_rows(slots: list[int]) -> torch.Tensor:
    return torch.tensor([s >= 0 for s in slots])


def shrink_f64(x: torch.Tensor, a: torch.Tensor, slots: list[int]) -> torch.Tensor:
    h = torch.einsum("ti,tri->tr", x.double().cpu(), gathered(a, slots))
    return torch.where(live_rows(slots)[:, None], h, 0.0)


def expand_f64(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    s = scales.double().cpu()[torch.tensor(slots).clamp_min(0)]
    delta = torch.einsum("tr,tor->to", h.double().cpu(), gathered(b, slots)) * s[:, None]
    return torch.where(live_rows(slots)[:, None], y.double().cpu() + delta, y.double().cpu())


@pytest.fixture
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every buffer the shrink kernel must write in full (``h`` or the split-K partials) starts as NaN."""
    monkeypatch.setattr(triton_lora, "_fresh", lambda shape, device: poisoned(shape, torch.float32))
    yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split_k", [1, 3])  # one pass straight into h / K splits summed
def test_shrink(dtype: torch.dtype, case: str, split_k: int, nan_buffers: None) -> None:
    slots, d_in, _, rank, tiles = CASES[case]
    gen = torch.Generator().manual_seed(len(slots) * d_in + rank)
    # x is a column slice too: the kernel must honour its row stride.
    x = with_nan_rows(randn(gen, len(slots), d_in + 8, dtype=dtype)[:, 3 : 3 + d_in], slots)
    a = weights(gen, rank, d_in, dtype=dtype)
    batch = slot_batch(slots)
    block_k = 16 if split_k > 1 else 32
    h = lora_shrink_triton(x, a, batch.token_slots, split_k=split_k, block_k=block_k, **tiles)
    ref = lora_shrink_ref(x, a, batch)
    expected = shrink_f64(x, a, slots)
    assert h.shape == (len(slots), rank) and h.dtype == torch.float32
    assert rel_err(ref, expected) < tol(dtype)
    if not batch.active:
        assert torch.equal(h, torch.zeros_like(h)) and torch.equal(ref, h)
        return
    assert rel_err(h, ref) < tol(dtype)
    assert rel_err(h, expected) < tol(dtype)
    assert torch.equal(h[~live_rows(slots).to(h.device)], torch.zeros_like(h[~live_rows(slots).to(h.device)]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_expand_into_column_slice(dtype: torch.dtype, case: str) -> None:
    slots, _, d_out, rank, tiles = CASES[case]
    gen = torch.Generator().manual_seed(len(slots) * d_out + rank)
    tokens = len(slots)
    fused = randn(gen, tokens, d_out + 24, dtype=dtype)  # e.g. qkv; y is the middle columns
    y = fused[:, 16 : 16 + d_out]
    h = with_nan_rows(randn(gen, tokens, rank) * 4, slots)
    b = weights(gen, d_out, rank, dtype=dtype)
    scales = (torch.rand(NUM_SLOTS, generator=gen) * 2 + 0.25).to(DEVICE)
    batch = slot_batch(slots)
    before = fused.clone()
    expected = expand_f64(y, h, b, scales, slots)
    ref = lora_expand_ref(y.clone(), h, b, scales, batch)
    got = lora_expand_triton(y, h, b, scales, batch.token_slots, block_n=16, **tiles)
    assert got is y
    assert rel_err(ref, expected) < tol(dtype)
    assert rel_err(y, ref) < tol(dtype)
    assert rel_err(y, expected) < tol(dtype)
    live = live_rows(slots).to(y.device)
    if batch.active:  # the added part alone (y's base values must not hide a wrong delta)
        base = before[:, 16 : 16 + d_out].double().cpu()
        assert rel_err((y.double().cpu() - base)[live.cpu()], (expected - base)[live.cpu()]) < tol(dtype)
    assert torch.equal(fused[~live], before[~live]), "rows without an adapter changed"
    assert torch.equal(fused[:, :16], before[:, :16]) and torch.equal(
        fused[:, 16 + d_out :], before[:, 16 + d_out :]
    )


@pytest.mark.parametrize(
    ("y_dtype", "w_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]
)
def test_expand_mixed_dtypes_and_transposed_y(y_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """``y`` in another dtype than the weights, laid out column-major (any 2-D strides work)."""
    slots = [0, -1, 3, 2, 0]
    gen = torch.Generator().manual_seed(7)
    store = randn(gen, 40, len(slots), dtype=y_dtype)
    y = store.t()  # [tokens, 40], strides (1, tokens)
    h = randn(gen, len(slots), 6)
    b = weights(gen, 40, 6, dtype=w_dtype)
    scales = torch.tensor([0.5, 1.0, 2.0, 1.5], device=DEVICE)
    batch = slot_batch(slots)
    expected = expand_f64(y, h, b, scales, slots)
    ref = lora_expand_ref(y.clone(), h, b, scales, batch)
    lora_expand_triton(y, h, b, scales, batch.token_slots)
    assert rel_err(ref, expected) < tol(y_dtype)
    assert rel_err(y, ref) < tol(y_dtype) and rel_err(y, expected) < tol(y_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_shrink_then_expand(dtype: torch.dtype) -> None:
    """The engine's path: lora_shrink then lora_expand through the Triton dispatch, vs the references."""
    slots = [1, 1, -1, 0, 3, 1, 2, 0, -1]
    gen = torch.Generator().manual_seed(11)
    x = randn(gen, len(slots), 64, dtype=dtype)
    a, b = randn(gen, NUM_SLOTS, 8, 64, dtype=dtype), randn(gen, NUM_SLOTS, 48, 8, dtype=dtype) * 0.1
    scales = torch.tensor([2.0, 0.5, 1.0, 4.0], device=DEVICE)
    batch = LoraBatch.build(slots, device=DEVICE)
    y0 = randn(gen, len(slots), 48 + 32, dtype=dtype)
    y_tri, y_ref = y0.clone(), y0.clone()
    with force_triton():
        h = lora_shrink(x, a, batch)  # default tiles: heuristic split count
        out = lora_expand(y_tri[:, 32:], h, b, scales, batch)
    h_ref = lora_shrink_ref(x, a, batch)
    lora_expand_ref(y_ref[:, 32:], h_ref, b, scales, batch)
    assert out.data_ptr() == y_tri[:, 32:].data_ptr()
    assert rel_err(h, h_ref) < tol(dtype)
    assert rel_err(y_tri, y_ref) < tol(dtype)
    expected = expand_f64(y0[:, 32:], shrink_f64(x, a, slots), b, scales, slots)
    assert rel_err(y_tri[:, 32:], expected) < tol(dtype)
    assert torch.equal(y_tri[:, :32], y0[:, :32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_against_float64(dtype: torch.dtype) -> None:
    """The references alone (no interpreter, so larger): grouped GEMMs vs per-token gathers."""
    gen = torch.Generator().manual_seed(3)
    slots = torch.randint(-1, 8, (96,), generator=gen).tolist()
    batch = LoraBatch.build(slots, device=DEVICE)
    x, a = randn(gen, 96, 256, dtype=dtype), randn(gen, 8, 16, 256, dtype=dtype)
    b, scales = randn(gen, 8, 192, 16, dtype=dtype), (torch.rand(8, generator=gen) + 0.5).to(DEVICE)
    h = lora_shrink_ref(x, a, batch)
    assert rel_err(h, shrink_f64(x, a, slots)) < tol(dtype)
    y = randn(gen, 96, 192, dtype=dtype)
    expected = expand_f64(y, h, b, scales, slots)
    assert rel_err(lora_expand_ref(y, h, b, scales, batch), expected) < tol(dtype)


def test_empty_batch_and_shape_errors() -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = randn(gen, NUM_SLOTS, 4, 32), randn(gen, NUM_SLOTS, 16, 4)
    no_tokens = torch.empty(0, dtype=torch.int32, device=DEVICE)
    assert lora_shrink_triton(randn(gen, 0, 32), a, no_tokens).shape == (0, 4)
    y = randn(gen, 0, 16)
    assert lora_expand_triton(y, randn(gen, 0, 4), b, torch.ones(NUM_SLOTS), no_tokens) is y
    slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="features"):
        lora_shrink_triton(randn(gen, 2, 24), a, slots)
    with pytest.raises(ValueError, match="token_slots"):
        lora_shrink_triton(randn(gen, 3, 32), a, slots)
    with pytest.raises(ValueError, match="h must be"):
        lora_expand_triton(randn(gen, 2, 16), randn(gen, 2, 8), b, torch.ones(NUM_SLOTS), slots)
    with pytest.raises(ValueError, match="columns"):
        lora_expand_triton(randn(gen, 2, 12), randn(gen, 2, 4), b, torch.ones(NUM_SLOTS), slots)


def test_split_heuristic() -> None:
    """Few token tiles split K to fill the GPU; splits never get shorter than the minimum; many
    tiles (a prefill chunk) or a short K run in one pass."""
    assert triton_lora.choose_shrink_split(1, 4096, 128, 132) == 16
    assert triton_lora.choose_shrink_split(16, 4096, 128, 132) == 16
    assert triton_lora.choose_shrink_split(300, 4096, 128, 132) == 1
    assert triton_lora.choose_shrink_split(1, 200, 32, 8) == 1


def test_bench_entries_check_against_the_reference() -> None:
    """The GPU benchmark's LoRA entries (dry-run shapes, here through the interpreter) check every
    configuration against the reference and report it."""
    from kernels.bench.run import DRY, TINY, Bench, bench_lora

    if DEVICE != "cpu":
        pytest.skip("runs the benchmark's interpreter path")
    bench = Bench("cpu", torch.bfloat16, 16, budget_s=1e9)
    bench_lora(bench, TINY, DRY, summary=True)
    rows = [(r.kernel, r.extra["tokens"], r.extra["rank"]) for r in bench.rows]
    cases = [(t, r) for t in (*DRY.lora_decode, DRY.lora_prefill) for r in DRY.lora_ranks]
    assert rows == [(k, t, r) for t, r in cases for k in ("lora_shrink", "lora_expand")]
    assert all(r.ok for r in bench.rows) and bench.failures == []
