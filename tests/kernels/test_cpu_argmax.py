"""The compiled greedy pick (kernels/csrc/argmax_cpu.cpp): each row's first maximum and whether the row
is all finite, against torch's reductions, with outputs poisoned before the call."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kernels.argmax import argmax_rows, argmax_rows_ref
from kernels.cpu_kernels import cpu_kernels


@pytest.fixture(scope="module")
def compiled() -> ModuleType:
    module = cpu_kernels()
    assert module is not None, "the CPU kernels did not build on this machine"
    return module


def _run(compiled: ModuleType, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    ids = torch.full((rows,), -7, dtype=torch.long)  # poisoned: a row the kernel skips keeps -7
    finite = torch.arange(rows) % 2 == 0  # poisoned: half of them wrong whichever answer is right
    compiled.argmax_rows(logits, ids, finite)
    return ids, finite


# Vocabularies below one vector group, between groups, across kernel blocks, and SmolLM2's.
@pytest.mark.parametrize("vocab", [1, 15, 64, 1000, 1024, 1025, 4133, 49152])
@pytest.mark.parametrize("rows", [1, 6, 33])
def test_random_rows_match_torch(compiled: ModuleType, rows: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows * 100_003 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 5
    ids, finite = _run(compiled, logits)
    assert torch.equal(ids, logits.max(dim=-1).indices)
    assert finite.all()
    got = argmax_rows(logits)  # the dispatcher takes the compiled path
    assert torch.equal(got[0], ids) and torch.equal(got[1], finite)


def test_ties_give_the_first_maximum(compiled: ModuleType) -> None:
    vocab = 3000  # three kernel blocks, the last one ragged
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5))
    places = [(7, 900), (1500, 2999), (1023, 1024), (0, 2048), (2999,), (64, 65, 2000)]
    for row, cols in enumerate(places):
        logits[row, list(cols)] = 50.0
    ids, finite = _run(compiled, logits)
    assert ids.tolist() == [cols[0] for cols in places]
    assert torch.equal(ids, argmax_rows_ref(logits)[0]) and finite.all()


def test_non_finite_rows_are_flagged_alone(compiled: ModuleType) -> None:
    vocab = 1025  # one value past the vector groups of the second block: the scalar tail
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(9))
    logits[1, 3] = float("nan")
    logits[2, 1024] = float("inf")  # in the tail
    logits[3, 700] = float("-inf")
    logits[4, :] = float("nan")
    logits[5, 0] = 3e38  # huge but finite: a sum over the row would overflow, the kernel must not care
    logits[5, 1] = 3e38
    ids, finite = _run(compiled, logits)
    assert finite.tolist() == [True, False, False, False, False, True, True]
    assert torch.equal(finite, argmax_rows_ref(logits)[1])
    assert ids[5] == 0
    assert ids[0] == logits[0].argmax() and ids[6] == logits[6].argmax()


def test_refuses_what_it_cannot_read(compiled: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="fp32"):
        _run(compiled, torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        _run(compiled, torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.zeros(8))
    # what the kernel does not take, the dispatcher serves from the reference
    strided = torch.randn(16, 5).t()
    assert torch.equal(argmax_rows(strided)[0], strided.max(dim=-1).indices)
    bf16 = torch.randn(3, 50).bfloat16()
    assert torch.equal(argmax_rows(bf16)[0], bf16.max(dim=-1).indices)
