"""The pool's ledger of fair-share service: what each replica gave each (class, tenant), summed.

Each replica reports its own cumulative weighted service (worker/fair_share.py's ``served``) about
once a second and gets back what the pool's other replicas gave, which it adds to its counters
(``set_remote``). One ledger per deployment, a small named Ray actor (serving/ledger.py).
Cumulative totals make a lost or repeated report harmless: the next one replaces it. A replica
that is gone keeps its last report: that service was given.
"""

from __future__ import annotations

from collections import defaultdict

from common import Priority

Key = tuple[Priority, str]  # (class, tenant), as the engine's fair share counts them


class PoolLedger:
    def __init__(self) -> None:
        self._by_replica: dict[str, dict[Key, float]] = {}

    def report(self, replica: str, served: dict[Key, float]) -> dict[Key, float]:
        """Record ``replica``'s service; returns the other replicas' summed per key."""
        self._by_replica[replica] = dict(served)
        remote: dict[Key, float] = defaultdict(float)
        for other, given in self._by_replica.items():
            if other != replica:
                for key, service in given.items():
                    remote[key] += service
        return dict(remote)
