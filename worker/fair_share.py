"""Weighted fair sharing of service between tenants inside one priority class.

Service is what the engine computed for a tenant: prefill tokens at one cost and decode tokens at
another (VTC's defaults 1 and 2: a decode token holds a batch slot for a whole step and its KV for the
rest of the request). Tokens served from the prefix cache cost nothing, and neither do tokens
recomputed after a preemption (the scheduler chose that, not the tenant).

Each (class, tenant) pair keeps a virtual counter that grows by ``service / weight`` for the work
scheduled on its behalf; whoever has the smallest counter is served next. A tenant that was idle is
lifted to the smallest counter among the active ones when it comes back, so idleness is not banked as
credit (the Virtual Token Counter scheme of Sheng et al., OSDI'24, with weights). When a class goes
idle, its counters are brought level: service a tenant got while it was alone is not a debt it pays
when the others come back before it does.

Across the replicas of a pool the counters are one: each replica adds to its own counters the
weighted service every tenant got on the other replicas (``set_remote``, from the pool's ledger,
serving/pool_ledger.py). A tenant whose requests are spread over many replicas then yields, on the
one it shares with a tenant pinned there (by an adapter or prefix affinity), as VTC's distributed
variant does: fairness is of the pool's service, not of each replica's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from common import Priority

Key = tuple[Priority, str]


@dataclass(frozen=True)
class ServiceCosts:
    """What one computed token costs, by phase."""

    prefill: float = 1.0
    decode: float = 2.0

    def __post_init__(self) -> None:
        if not (self.prefill > 0 and self.decode > 0):
            raise ValueError("service costs must be positive")


class FairShare:
    def __init__(self, costs: ServiceCosts | None = None) -> None:
        self.costs = costs or ServiceCosts()
        self._counter: dict[Key, float] = defaultdict(float)
        self._active: dict[Key, int] = defaultdict(int)  # live sequences per key
        self._served: dict[Key, float] = defaultdict(float)  # weighted service given here, per key
        # Weighted service given on the pool's other replicas (replaced whole, never mutated: a
        # driver thread may swap it while the engine's thread reads it).
        self._remote: dict[Key, float] = {}
        self._level: dict[Priority, float] = {}  # where every counter of a class stood when it went idle
        self.tokens: dict[str, int] = defaultdict(int)  # tokens charged per tenant (for stats/tests)
        self.service: dict[str, float] = defaultdict(float)  # service charged per tenant, unweighted

    def counter(self, priority: Priority, tenant: str) -> float:
        return self._total((priority, tenant))

    def _total(self, key: Key) -> float:
        return self._counter[key] + self._remote.get(key, 0.0)

    def set_remote(self, served: dict[Key, float]) -> None:
        """The weighted service each key got on the pool's other replicas (cumulative)."""
        self._remote = dict(served)

    def served(self) -> dict[Key, float]:
        """The weighted service each key got on this replica (cumulative): what the ledger sums."""
        return dict(self._served)

    def activate(self, priority: Priority, tenant: str) -> None:
        """A sequence of ``tenant`` entered class ``priority``."""
        key = (priority, tenant)
        if self._active[key] == 0:
            floor = [self._total(k) for k, n in self._active.items() if n and k[0] == priority]
            lift = max(min(floor, default=0.0), self._level.get(priority, 0.0))
            self._counter[key] += max(0.0, lift - self._total(key))
        self._active[key] += 1

    def deactivate(self, priority: Priority, tenant: str) -> None:
        key = (priority, tenant)
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]
            if not any(k[0] == priority for k in self._active):
                self._forget(priority)

    def _forget(self, priority: Priority) -> None:
        """The class went idle here: nobody waited, so nobody was wronged. Every tenant's counter
        is brought level (to the highest), so service given while the others were away is not owed
        back later (whoever comes back first must not find a debt the lift on return cannot see)."""
        keys = [k for k in self._counter if k[0] == priority]
        top = max((self._total(k) for k in keys), default=0.0)
        for k in keys:
            self._counter[k] += top - self._total(k)
        self._level[priority] = top  # and a tenant never seen here yet starts level with them

    def charge(self, priority: Priority, tenant: str, weight: float, prefill: int, decode: int) -> None:
        """Charge ``tenant`` for ``prefill`` and ``decode`` tokens (negative counts refund them)."""
        service = self.costs.prefill * prefill + self.costs.decode * decode
        self._counter[(priority, tenant)] += service / weight
        self._served[(priority, tenant)] += service / weight
        self.service[tenant] += service
        self.tokens[tenant] += prefill + decode

    def over_share(self, priority: Priority, tenant: str) -> float:
        """How far ahead of the least-served active tenant of its class this tenant is."""
        floor = min((self._total(k) for k, n in self._active.items() if n and k[0] == priority), default=0.0)
        return self._total((priority, tenant)) - floor
