"""Turns next-token logits into tokens: greedy, or temperature with top-k/top-p, per request.

Each sampled request draws from its own random source, seeded from the request's seed when it has
one, and the draw for an output position depends on the seed and that position only: the token is
where a uniform number keyed by (seed, position) falls in the row's cumulative distribution. So the
same seed gives the same text whatever else shares the batch, however many tokens a step verified
for it (speculative decoding compares a proposal with exactly this draw), and after a resume.

A row whose logits are not all finite (a numerical fault), or whose sampling raises for any reason,
gets no token but a ``RowFailed``: its request fails alone and every other row of the batch is
sampled as usual (nothing one request sends may fail the step of the others). Temperatures below
``LIMITS.greedy_below_temperature`` are greedy, so a division can never overflow finite logits, and
top-p always keeps the most probable token, so no value of it leaves a row nothing to draw from (a
JSON ``top_p`` of 1e-46 is 0.0 in float32).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass

import torch

from kernels.argmax import argmax_rows
from kernels.token_mask import apply_token_bitmask_, masked_argmax
from protocol.requests import SamplingParams, TokenLogprob
from worker.grammars import StepMasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowFailed:
    """A row that got no token, and why (said to its request's caller)."""

    reason: str


NON_FINITE = RowFailed("the model produced non-finite logits for this request")
NOTHING_ALLOWED = RowFailed("the output constraint allows no token here")


class RequestRng:
    """A request's random source: one uniform number per output position, keyed by (seed, position)
    (a hash, not a stream: identical on every device and in whatever order positions are drawn)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed if seed is not None else secrets.randbits(63)

    def uniform(self, position: int) -> float:
        digest = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)  # [0, 1), 53 bits

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token at ``position`` from ``probs`` (unnormalized is fine): inverse-CDF sampling."""
        cdf = torch.cumsum(probs.double(), dim=-1)
        total = float(cdf[-1])
        if not total > 0:
            raise ValueError("nothing to draw from")
        at = int(
            torch.searchsorted(
                cdf, torch.tensor([self.uniform(position) * total], dtype=torch.float64), right=True
            )
        )
        return min(at, probs.shape[-1] - 1)


def _sample_one(logits: torch.Tensor, params: SamplingParams, rng: RequestRng, position: int) -> int:
    return rng.draw(probabilities(logits, params), position)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from (CPU, fp32): temperature, then top-k, then top-p."""
    logits = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly ahead of each token
        drop = before >= params.top_p
        drop[0] = False  # the most probable token stays, however small top_p is
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    rngs: list[RequestRng | None],
    masks: StepMasks | None = None,
    positions: list[int] | None = None,
) -> list[int | RowFailed]:
    """One token per row of ``logits [n, vocab]``, or why that row got none. ``masks``: the grammar
    masks of the constrained rows (a sampled one's logits are masked in place). ``positions``: the
    sequence position each row's token takes (its draw is keyed by it; default 0)."""
    # One pass gives every row's greedy pick and finiteness (kernels/argmax.py); a sampled row
    # ignores its pick, a constrained one is picked again among its allowed tokens.
    picks, finite = argmax_rows(logits)
    pick_of = picks.tolist()
    failed: dict[int, RowFailed] = {}
    if masks is not None:
        failed = {row: RowFailed(reason) for row, reason in masks.failed}
        _constrain(logits, params, masks, pick_of, failed)
    out: list[int | RowFailed] = []
    for i, (p, pick, ok) in enumerate(zip(params, pick_of, finite.tolist(), strict=True)):
        if not ok:
            out.append(NON_FINITE)
        elif i in failed:
            out.append(failed[i])
        elif p.greedy:
            out.append(pick)
        else:
            rng = rngs[i]
            assert rng is not None, "a sampled request needs its RequestRng"
            try:
                out.append(_sample_one(logits[i], p, rng, positions[i] if positions else 0))
            except Exception as exc:  # this row's values, never the batch's problem
                log.warning(
                    "sampling failed for one row (%s: %s); its request is stopped", type(exc).__name__, exc
                )
                out.append(RowFailed(f"sampling failed for this request ({type(exc).__name__})"))
    return out


def _constrain(
    logits: torch.Tensor,
    params: list[SamplingParams],
    masks: StepMasks,
    pick_of: list[int],
    failed: dict[int, RowFailed],
) -> None:
    """Greedy constrained rows: their pick among the allowed tokens (the logits stay as they are).
    Sampled ones: their disallowed logits set to -inf. A row whose mask allows nothing fails."""
    rows = masks.rows.tolist()
    greedy = [j for j, r in enumerate(rows) if params[r].greedy]
    drawn = [j for j, r in enumerate(rows) if not params[r].greedy]
    if greedy:
        at = torch.tensor(greedy, dtype=torch.long)
        ids, found = masked_argmax(logits, masks.rows[at], masks.bitmask[at])
        for j, token, ok in zip(greedy, ids.tolist(), found.tolist(), strict=True):
            pick_of[rows[j]] = token
            if not ok:
                failed.setdefault(rows[j], NOTHING_ALLOWED)
    if drawn:
        at = torch.tensor(drawn, dtype=torch.long)
        found = apply_token_bitmask_(logits, masks.rows[at], masks.bitmask[at])
        for j, ok in zip(drawn, found.tolist(), strict=True):
            if not ok:
                failed.setdefault(rows[j], NOTHING_ALLOWED)


def token_logprobs(
    logits: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]
) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens[i]`` in row ``rows[i]`` and the row's ``tops[i]`` best tokens."""
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    k = max(tops, default=0)
    values, indices = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    best_v, best_i = values.tolist(), indices.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(best_i[j][:n], best_v[j][:n], strict=True)))
        for j, (t, lp, n) in enumerate(zip(tokens, chosen, tops, strict=True))
    ]
