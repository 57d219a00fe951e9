"""Fairness measured as the VTC paper (Sheng et al., OSDI'24) states it, from per-step service.

Service is prefill tokens at ``w_p`` and decode tokens at ``w_q`` (VTC's defaults 1 and 2). For two
tenants ``f`` and ``g`` backlogged over an interval, the paper bounds the difference of their
weighted service, ``|W_f(t1, t2) / w_f - W_g(t1, t2) / w_g|``, by ``2 U`` with
``U = max(w_p * L_input, w_q * M)`` (``L_input`` the longest prompt, ``M`` the most tokens one
step can hold). The largest difference over every interval inside a window is the range (max - min)
of ``D(t) = S_f(t) / w_f - S_g(t) / w_g``, the cumulative difference. Jain's index over windows says
how evenly each window's weighted service was spread (1.0 is perfectly even).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.scheduler_sim import SchedulerSim
from serving.pool_ledger import PoolLedger

Served = dict[str, tuple[int, int]]  # tenant -> (prefill, decode) tokens in one step


@dataclass(frozen=True)
class Fairness:
    max_difference: float  # the largest weighted service difference over any interval, any pair
    mean_difference: float  # |D(t)|'s mean over steps and pairs, D measured from the window's start
    variance: float  # of that |D(t)|
    bound: float  # VTC's 2 U
    jain_min: float  # the worst window's Jain index
    jain_mean: float
    jain_min_half: float  # the worst Jain index over windows half as long


def service(step: Served, tenant: str, w_p: float, w_q: float) -> float:
    prefill, decode = step.get(tenant, (0, 0))
    return w_p * prefill + w_q * decode


def vtc_bound(longest_prompt: int, step_tokens: int, w_p: float = 1.0, w_q: float = 2.0) -> float:
    return 2 * max(w_p * longest_prompt, w_q * step_tokens)


def jain(values: Iterable[float]) -> float:
    xs = list(values)
    square = sum(x * x for x in xs)
    return 1.0 if square == 0 else sum(xs) ** 2 / (len(xs) * square)


def measure(
    steps: Sequence[Served],
    weights: dict[str, float],
    *,
    bound: float,
    window: int,
    w_p: float = 1.0,
    w_q: float = 2.0,
) -> Fairness:
    """Fairness over ``steps``, during which every tenant of ``weights`` was backlogged."""
    pairs = list(itertools.combinations(sorted(weights), 2))
    cumulative = {t: 0.0 for t in weights}
    curves: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
    jains = _windowed_jain(steps, weights, window, w_p, w_q)
    halves = _windowed_jain(steps, weights, max(1, window // 2), w_p, w_q)
    for step in steps:
        for t in weights:
            cumulative[t] += service(step, t, w_p, w_q) / weights[t]
        for f, g in pairs:
            curves[(f, g)].append(cumulative[f] - cumulative[g])
    ranges = [max(c) - min(c) for c in curves.values() if c]
    drifts = [abs(d) for c in curves.values() for d in c]
    mean = sum(drifts) / len(drifts) if drifts else 0.0
    variance = sum((d - mean) ** 2 for d in drifts) / len(drifts) if drifts else 0.0
    return Fairness(
        max_difference=max(ranges, default=0.0),
        mean_difference=mean,
        variance=variance,
        bound=bound,
        jain_min=min(jains, default=1.0),
        jain_mean=sum(jains) / len(jains) if jains else 1.0,
        jain_min_half=min(halves, default=1.0),
    )


def _windowed_jain(
    steps: Sequence[Served], weights: dict[str, float], window: int, w_p: float, w_q: float
) -> list[float]:
    jains = []
    for start in range(0, len(steps) - window + 1, window):
        per = {t: sum(service(s, t, w_p, w_q) for s in steps[start : start + window]) for t in weights}
        jains.append(jain(per[t] / weights[t] for t in weights))
    return jains


Shapes = tuple[tuple[int, int], tuple[int, int]]  # (prompt length range, output length range)


def backlogged_run(
    weights: dict[str, float],
    shapes: dict[str, Shapes],
    costs: Any = None,  # the scheduler's ServiceCosts (default: VTC's 1 and 2)
    *,
    max_num_seqs: int = 16,
    step_budget: int = 256,
    steps: int = 2000,
    window: int = 200,
    seed: int = 0,
) -> Fairness:
    """Every tenant of ``weights`` kept backlogged (900 requests each per 16 sequences a step,
    lengths drawn from its ``shapes``) on the real scheduler with a stand-in model for ``steps``
    steps; fairness measured from the 20th step on, against VTC's bound with M the most tokens a
    running batch can hold."""
    rng = random.Random(seed)
    config: dict[str, Any] = {"costs": costs} if costs is not None else {}
    sim = SchedulerSim(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=step_budget,
        num_blocks=8192,
        block_size=16,
        **config,
    )
    longest_prompt = longest_output = 0
    for _ in range(900 * max(1, max_num_seqs // 16)):
        for tenant, weight in weights.items():
            (p_lo, p_hi), (o_lo, o_hi) = shapes[tenant]
            prompt, output = rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)
            longest_prompt, longest_output = max(longest_prompt, prompt), max(longest_output, output)
            sim.submit(prompt, output, tenant=tenant, weight=weight)
    for _ in range(steps):
        sim.step()
    waiting = sim.scheduler.waiting
    if not all(any(t in q for q in waiting.values()) for t in weights):
        raise RuntimeError("a tenant ran out of backlog: submit more requests or run fewer steps")
    batch_tokens = max_num_seqs * (longest_prompt + longest_output)
    return measure(sim.served[20:], weights, bound=vtc_bound(longest_prompt, batch_tokens), window=window)


def pool_run(
    weights: dict[str, float],
    shapes: dict[str, Shapes],
    pinned: dict[str, int],
    *,
    replicas: int = 2,
    ledger_every: int | None = 20,
    max_num_seqs: int = 64,
    step_budget: int = 512,
    steps: int = 2000,
    window: int = 200,
    seed: int = 0,
) -> tuple[Fairness, dict[str, float]]:
    """Backlogged tenants over a pool of ``replicas`` stepped in lockstep: a tenant in ``pinned``
    sends every request to that replica (an adapter or prefix affinity), the others spread theirs
    round-robin. Every ``ledger_every`` steps (None: never) the replicas share their service through
    the pool's ledger. Fairness is measured on the pool's service, and returned with each tenant's
    share of it."""
    rng = random.Random(seed)
    sims = [
        SchedulerSim(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=step_budget, num_blocks=8192, block_size=16
        )
        for _ in range(replicas)
    ]
    longest_prompt = 0
    per_replica = 900 * max(1, max_num_seqs // 16)
    for i in range(per_replica * replicas):
        for tenant, weight in weights.items():
            target = pinned.get(tenant, i % replicas)
            if tenant in pinned and i >= per_replica:
                continue
            (p_lo, p_hi), (o_lo, o_hi) = shapes[tenant]
            prompt = rng.randint(p_lo, p_hi)
            longest_prompt = max(longest_prompt, prompt)
            sims[target].submit(prompt, rng.randint(o_lo, o_hi), tenant=tenant, weight=weight)
    ledger = PoolLedger()
    for step in range(steps):
        for sim in sims:
            sim.step()
        if ledger_every and (step + 1) % ledger_every == 0:
            for r, sim in enumerate(sims):
                sim.scheduler.fair.set_remote(ledger.report(f"r{r}", sim.scheduler.fair.served()))
    for tenant in weights:
        used = [pinned[tenant]] if tenant in pinned else range(replicas)
        if not any(any(tenant in q for q in sims[r].scheduler.waiting.values()) for r in used):
            raise RuntimeError("a tenant ran out of backlog: submit more requests or run fewer steps")
    pooled: list[Served] = []
    for per_step in zip(*(sim.served for sim in sims), strict=True):
        merged: Served = {}
        for served in per_step:
            for tenant, (p, d) in served.items():
                mp, md = merged.get(tenant, (0, 0))
                merged[tenant] = (mp + p, md + d)
        pooled.append(merged)
    pooled = pooled[20:]
    total = {t: sum(service(s, t, 1.0, 2.0) for s in pooled) for t in weights}
    shares = {t: round(v / sum(total.values()), 4) for t, v in total.items()}
    bound = vtc_bound(longest_prompt, replicas * max_num_seqs * (longest_prompt + 256))
    return measure(pooled, weights, bound=bound, window=window), shares
