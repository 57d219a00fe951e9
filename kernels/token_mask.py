"""Grammar masks over a step's logits: the greedy pick among a row's allowed tokens, or the row's
disallowed logits set to -inf before it is sampled.

The masks come as llguidance writes them: one bit per token, bit b of 32-bit word w for token
32 * w + b; tokens past the mask are not allowed. Only the constrained rows are read or touched, so an
unconstrained row beside them costs nothing; the greedy pick writes nothing (a row's log-probabilities
stay the model's). On CPU the compiled kernels run (csrc/token_mask_cpu.cpp); elsewhere, torch.
"""

from __future__ import annotations

import torch

from kernels.cpu_kernels import cpu_kernels_for

_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # [256, 8]


def _compiled(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> object | None:
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    if rows.dtype != torch.long or bitmask.dtype != torch.int32 or not bitmask.is_contiguous():
        return None
    return cpu_kernels_for(logits)


def masked_argmax(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, any)``: for each ``rows[i]``, the first allowed token with the largest logit, and
    whether the mask allows any token at all (if not, ``ids[i]`` is unspecified)."""
    if (compiled := _compiled(logits, rows, bitmask)) is not None:
        ids = torch.empty(rows.shape[0], dtype=torch.long)
        found = torch.empty(rows.shape[0], dtype=torch.bool)
        compiled.masked_argmax(logits, rows, bitmask, ids, found)  # type: ignore[attr-defined]
        return ids, found
    return masked_argmax_ref(logits, rows, bitmask)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: ``logits[rows[i], t] = -inf`` for each token ``t`` that ``bitmask[i]`` does not allow.
    Returns whether each of those rows allows any token (``bool [k]``)."""
    if (compiled := _compiled(logits, rows, bitmask)) is not None:
        found = torch.empty(rows.shape[0], dtype=torch.bool)
        compiled.apply_token_bitmask(logits, rows, bitmask, found)  # type: ignore[attr-defined]
        return found
    return apply_token_bitmask_ref_(logits, rows, bitmask)


# ---- torch references ---------------------------------------------------------------------------


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``bool [k, vocab]``: which tokens ``bitmask`` (``int32 [k, words]``) allows in each row."""
    table = _BYTE_BITS.to(bitmask.device)
    flags = table[bitmask.contiguous().view(torch.uint8).long()]  # [k, 4 * words, 8]: little-endian bytes
    flags = flags.reshape(bitmask.shape[0], -1)
    if flags.shape[1] < vocab:
        flags = torch.nn.functional.pad(flags, (0, vocab - flags.shape[1]), value=False)
    return flags[:, :vocab]


def masked_argmax_ref(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    sub = logits.index_select(0, rows).float().masked_fill(~allowed, float("-inf"))
    # An allowed -inf logit must still win over the disallowed ones: rank allowed before value.
    sub = torch.where(allowed, sub.nan_to_num(neginf=torch.finfo(torch.float32).min), float("-inf"))
    return sub.max(dim=1).indices, allowed.any(dim=1)


def apply_token_bitmask_ref_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
    return allowed.any(dim=1)
