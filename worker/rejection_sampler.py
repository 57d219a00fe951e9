"""Verifying a row's proposed tokens against the model's own choices in one step.

A row that proposed ``k`` tokens has ``k + 1`` logits rows: row ``i`` is the model's next-token
distribution after the row's tokens and the first ``i`` proposals. Greedy: a proposal holds while it
is the model's argmax, and the first argmax that differs (or the one after the last proposal) is
the bonus token, so the output is exactly what decoding one token a step gives. Sampled: proposal
``x`` from a proposer that puts all its mass on it holds with probability ``p(x)``; when it fails,
the token is drawn from ``p`` without ``x``, renormalized. That is speculative sampling (Leviathan
et al., Chen et al.) with a one-point draft distribution, and each token is distributed exactly as
sampling ``p`` alone would be. Draws come from the request's own generator, so a seed reproduces
the output.
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
) -> list[int] | RowFailed:
    """The tokens a row gains: its accepted proposals, then one the model chose.

    ``logits [k + 1, vocab]`` with ``picks`` their argmaxes and ``finite`` whether all are finite."""
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
    for i, token in enumerate(proposal):
        probs = probabilities(logits[i], params)
        if torch.rand(1, generator=rng.generator).item() < probs[token].item():
            out.append(token)
            continue
        probs[token] = 0.0
        return [*out, int(torch.multinomial(probs, 1, generator=rng.generator).item())]
    probs = probabilities(logits[len(proposal)], params)
    return [*out, int(torch.multinomial(probs, 1, generator=rng.generator).item())]
