"""SLO-aware admission: a request whose tenant has a latency target for its class is admitted only
if the replicas' published load says its first token can come in time.

The prediction is plain queueing arithmetic over what each replica publishes (protocol/stats.py):
the prompt tokens already waiting in the request's class and the classes served before it, plus its
own prompt, at the rate that replica has lately computed tokens, plus one step for the step in
flight. The best replica counts, since the router sends a request to the least loaded one.
Published load is up to a second old, so the prompt tokens this gateway admitted since a pool's
replicas last published are added, spread over them: a burst cannot all pass on one stale reading.

A predicted miss is refused at once with the prediction and the target (RESOURCE_EXHAUSTED, a
retry-after of the excess), or, where the admin chose ``queue`` for the class, admitted to wait.
Every request of a class with a target is counted when it ends, met or missed, so goodput under
SLO is a metric per tenant and class (``loom:slo_requests_total``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from common import Priority
from gateway.engine_pool import EnginePool
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
    computed_tokens: int = 0
    step_seconds: float = 0.0
    rate: float | None = None  # tokens per busy second, over the last readings that moved enough


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tokens_ahead: int  # on the replica the prediction is for, the request's own prompt included


class SloAdmission:
    def __init__(self) -> None:
        self._replicas: dict[tuple[str, str], _Replica] = {}
        self._unpublished: dict[str, tuple[tuple[tuple[str, int], ...], int]] = {}

    def _rate(self, pool: str, name: str, s: EngineStats) -> float | None:
        r = self._replicas.setdefault((pool, name), _Replica())
        d_seconds = s.step_seconds - r.step_seconds
        if d_seconds >= _MIN_RATE_WINDOW_S:
            r.rate = (s.computed_tokens - r.computed_tokens) / d_seconds
            r.computed_tokens, r.step_seconds = s.computed_tokens, s.step_seconds
        elif d_seconds < 0:  # the replica restarted
            r.computed_tokens, r.step_seconds, r.rate = s.computed_tokens, s.step_seconds, None
        if r.rate:
            return r.rate
        return s.computed_tokens / s.step_seconds if s.step_seconds > 0 else None

    def predict(self, pool: EnginePool, priority: Priority, prompt_tokens: int) -> Prediction | None:
        """The earliest first token any replica of ``pool`` can give; None when none can tell yet."""
        stats = pool.replica_stats()
        signature = tuple(sorted((name, s.num_steps) for name, s in stats.items()))
        seen, unpublished = self._unpublished.get(pool.name, (signature, 0))
        if seen != signature:
            unpublished = 0
        self._unpublished[pool.name] = (signature, unpublished)
        best: Prediction | None = None
        for name, s in stats.items():
            rate = self._rate(pool.name, name, s)
            if not rate or not s.num_steps:
                continue
            ahead = sum(n for p, n in s.pending_prompt_tokens.items() if p <= priority)
            ahead += unpublished // max(1, len(stats)) + prompt_tokens
            guess = Prediction(ahead / rate + s.step_seconds / s.num_steps, ahead)
            if best is None or guess.ttft_s < best.ttft_s:
                best = guess
        return best

    def admit(self, tenant: Tenant, priority: Priority, prompt_tokens: int, pool: EnginePool) -> None:
        """Refuse (GatewayError) a request predicted to miss its tenant's TTFT target, unless the
        target says to queue it; count it toward the pool's unpublished load when it goes on."""
        target = tenant.slo.get(priority)
        if target is not None and target.ttft_ms is not None:
            guess = self.predict(pool, priority, prompt_tokens)
            if guess is not None and guess.ttft_s * 1000 > target.ttft_ms:
                SLO_REQUESTS.labels(tenant.id, priority.value, _missed_outcome(target)).inc()
                if target.on_miss == "refuse":
                    raise _refusal(priority, target.ttft_ms / 1000, guess)
        seen, unpublished = self._unpublished.get(pool.name, ((), 0))
        self._unpublished[pool.name] = (seen, unpublished + prompt_tokens)


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
