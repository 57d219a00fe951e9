"""Verifying a row's proposed tokens against the model's own choices in one step.

A row that proposed ``k`` tokens has ``k + 1`` logits rows: row ``i`` is the model's next-token
distribution after the row's tokens and the first ``i`` proposals. Greedy: a proposal holds while it
is the model's argmax, and the first argmax that differs (or the one after the last proposal) is
the bonus token, so the output is exactly what decoding one token a step gives. Sampled: the token
for each position is drawn from ``p`` as one token a step would draw it (the request's draw for that
position, keyed by its seed and the position), and a proposal holds while it equals that draw. A
proposal ``x`` from a one-point draft then holds with probability ``p(x)``, and when it fails the
token is distributed as ``p`` without ``x``, renormalized: speculative sampling (Leviathan et al.,
Chen et al.) with a one-point draft, coupled to the plain draw. So a seed gives the same text with
speculation as without it, whatever was proposed.
"""

from __future__ import annotations

import torch

from protocol.requests import SamplingParams
from worker.sampler import NON_FINITE, RequestRng, RowFailed, probabilities


def verify(
    logits: torch.Tensor,
    picks: list[int],
    finite: bool,
    proposal: list[int],
    params: SamplingParams,
    rng: RequestRng | None,
    position: int = 0,
) -> list[int] | RowFailed:
    """The tokens a row gains: its accepted proposals, then one the model chose.

    ``logits [k + 1, vocab]`` with ``picks`` their argmaxes and ``finite`` whether all are finite;
    row ``i`` gives the token at sequence position ``position + i``."""
    if not finite:
        return NON_FINITE
    if params.greedy:
        out = []
        for i, token in enumerate(proposal):
            if picks[i] != token:
                break
            out.append(token)
        return [*out, picks[len(out)]]
    assert rng is not None, "a sampled request needs its RequestRng"
    out = []
    for i in range(len(proposal) + 1):
        token = rng.draw(probabilities(logits[i], params), position + i)
        if i == len(proposal) or token != proposal[i]:
            return [*out, token]
        out.append(token)
    raise AssertionError("unreachable")
