"""SLO-aware admission: a request whose tenant has a latency target for its class is admitted only
if the replicas' published load says its first token can come in time.

The prediction is plain queueing arithmetic over what each replica publishes (protocol/stats.py):
the prompt tokens already waiting in the request's class and the classes served before it, plus its
own prompt, at the pace that replica has lately computed prompt tokens in its full steps (those
that used half the token budget or more: the pace its prompt queues drain at, beside the decodes
that share each step), plus one mean step for the step in flight. The best replica counts, since
the router sends a request to the least loaded one.

Published load is up to a second old: the prompt tokens this gateway admitted since a pool's
replicas last published are added (those of its class and the classes before it, spread over the
replicas), so a burst cannot all pass on one stale reading, and what the replica worked off since
the reading was new is taken away at its pace, so a stale reading does not refuse what has gone.

A predicted miss is refused at once with the prediction and the target (RESOURCE_EXHAUSTED, a
retry-after of the excess), or, where the admin chose ``queue`` for the class, admitted to wait.
Every request of a class with a target is counted when it ends, met or missed, so goodput under
SLO is a metric per tenant and class (``loom:slo_requests_total``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from common import Priority
from gateway.errors import ErrorKind, GatewayError
from protocol.stats import EngineStats
from tenancy import SloTarget, Tenant

SLO_REQUESTS = Counter(
    "loom:slo_requests",
    "Requests of classes with a latency target, by how they ended against it: met, missed, refused "
    "(predicted to miss, refused before admission) or queued (predicted to miss, admitted to wait).",
    ["tenant", "priority", "outcome"],
)

# Below this much step time between two readings, the rate is taken over the replica's whole life.
_MIN_RATE_WINDOW_S = 0.2


@dataclass
class _Replica:
    prompt_tokens: int = 0  # full steps' prompt tokens and seconds at the last reading that moved enough
    seconds: float = 0.0
    rate: float | None = None  # prompt tokens per second of full steps between the last two such readings


@dataclass
class _Unpublished:
    """A pool's latest reading (replicas and their step counts), when this gateway first saw it,
    and the prompt tokens it admitted to the pool since, by class."""

    signature: tuple[tuple[str, int], ...]
    since: float
    tokens: dict[Priority, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tokens_ahead: int  # on the replica the prediction is for, the request's own prompt included


class SloAdmission:
    def __init__(self) -> None:
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._unpublished: dict[str, _Unpublished] = {}

    def _rate(self, pool: str, name: str, s: EngineStats) -> float | None:
        """Prompt tokens per second of the replica's full steps, over its latest readings that moved
        enough, else over its life; its steps' overall pace where it has had no full step."""
        r = self._replicas.setdefault((pool, name), _Replica())
        d_seconds = s.full_step_seconds - r.seconds
        if d_seconds >= _MIN_RATE_WINDOW_S:
            r.rate = (s.full_step_prompt_tokens - r.prompt_tokens) / d_seconds
            r.prompt_tokens, r.seconds = s.full_step_prompt_tokens, s.full_step_seconds
        elif d_seconds < 0:  # the replica restarted
            r.prompt_tokens, r.seconds, r.rate = s.full_step_prompt_tokens, s.full_step_seconds, None
        if r.rate:
            return r.rate
        if s.full_step_seconds > 0:
            return s.full_step_prompt_tokens / s.full_step_seconds
        return s.computed_tokens / s.step_seconds if s.step_seconds > 0 else None

    def predict(
        self,
        pool: str,
        stats: dict[str, EngineStats],
        priority: Priority,
        prompt_tokens: int,
        now: float | None = None,
    ) -> Prediction | None:
        """The earliest first token any replica of ``pool`` (whose published ``stats`` these are)
        can give; None when none can tell yet. ``now``: the gateway's clock (monotonic)."""
        now = time.monotonic() if now is None else now
        signature = tuple(sorted((name, s.num_steps) for name, s in stats.items()))
        seen = self._unpublished.get(pool)
        if seen is None or seen.signature != signature:
            seen = self._unpublished[pool] = _Unpublished(signature, now)
        unpublished = sum(n for p, n in seen.tokens.items() if p <= priority) / max(1, len(stats))
        best: Prediction | None = None
        for name, s in stats.items():
            rate = self._rate(pool, name, s)
            if not rate or not s.num_steps:
                continue
            queued = sum(n for p, n in s.pending_prompt_tokens.items() if p <= priority) + unpublished
            # What the replica has worked off since the reading was new.
            ahead = int(max(0.0, queued - rate * (now - seen.since))) + prompt_tokens
            guess = Prediction(ahead / rate + s.step_seconds / s.num_steps, ahead)
            if best is None or guess.ttft_s < best.ttft_s:
                best = guess
        return best

    def admit(
        self,
        tenant: Tenant,
        priority: Priority,
        prompt_tokens: int,
        pool: str,
        stats: Callable[[], dict[str, EngineStats]],
        now: float | None = None,
    ) -> None:
        """Refuse (GatewayError) a request predicted to miss its tenant's TTFT target, unless the
        target says to queue it; count it toward the pool's unpublished load when it goes on.
        ``stats`` reads the pool's published stats: only a request with a target needs them."""
        target = tenant.slo.get(priority)
        if target is not None and target.ttft_ms is not None:
            guess = self.predict(pool, stats(), priority, prompt_tokens, now)
            if guess is not None and guess.ttft_s * 1000 > target.ttft_ms:
                SLO_REQUESTS.labels(tenant.id, priority.value, _missed_outcome(target)).inc()
                if target.on_miss == "refuse":
                    raise _refusal(priority, target.ttft_ms / 1000, guess)
        seen = self._unpublished.get(pool)
        if seen is not None:
            seen.tokens[priority] = seen.tokens.get(priority, 0) + prompt_tokens


def _missed_outcome(target: SloTarget) -> str:
    return "refused" if target.on_miss == "refuse" else "queued"


def _refusal(priority: Priority, target_s: float, guess: Prediction) -> GatewayError:
    return GatewayError(
        ErrorKind.RESOURCE_EXHAUSTED,
        f"predicted time to first token {guess.ttft_s:.2f} s exceeds this tenant's {priority.value} "
        f"target of {target_s:.2f} s ({guess.tokens_ahead} prompt tokens queued ahead of it on the "
        "least loaded replica); retry later, or send it at a lower priority",
        retry_after_s=round(guess.ttft_s - target_s, 3),
        limit=f"slo_{priority.value}_ttft",
    )


def record_outcome(tenant: Tenant, priority: Priority, ttft_s: float | None, tpot_s: float | None) -> None:
    """Count an admitted request of a class with a target as met or missed when it ends."""
    target = tenant.slo.get(priority)
    if target is not None:
        outcome = "met" if target.met(ttft_s, tpot_s) else "missed"
        SLO_REQUESTS.labels(tenant.id, priority.value, outcome).inc()
