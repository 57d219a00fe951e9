"""Weighted fair sharing of tokens between tenants inside one priority class.

Each (class, tenant) pair keeps a virtual token counter that grows by ``tokens / weight`` for the
work scheduled on its behalf; whoever has the smallest counter is served next. A tenant that was idle
is lifted to the smallest counter among the active ones when it comes back, so idleness is not
banked as credit (the Virtual Token Counter scheme of Sheng et al., OSDI'24, with weights).
"""

from __future__ import annotations

from collections import defaultdict

from common import Priority

Key = tuple[Priority, str]


class FairShare:
    def __init__(self) -> None:
        self._counter: dict[Key, float] = defaultdict(float)
        self._active: dict[Key, int] = defaultdict(int)  # live sequences per key
        self.tokens: dict[str, int] = defaultdict(int)  # tokens scheduled per tenant (for stats/tests)

    def counter(self, priority: Priority, tenant: str) -> float:
        return self._counter[(priority, tenant)]

    def activate(self, priority: Priority, tenant: str) -> None:
        """A sequence of ``tenant`` entered class ``priority``."""
        key = (priority, tenant)
        if self._active[key] == 0:
            floor = [self._counter[k] for k, n in self._active.items() if n and k[0] == priority]
            if floor:
                self._counter[key] = max(self._counter[key], min(floor))
        self._active[key] += 1

    def deactivate(self, priority: Priority, tenant: str) -> None:
        key = (priority, tenant)
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]

    def charge(self, priority: Priority, tenant: str, weight: float, tokens: int) -> None:
        self._counter[(priority, tenant)] += tokens / weight
        self.tokens[tenant] += tokens

    def over_share(self, priority: Priority, tenant: str) -> float:
        """How far ahead of the least-served active tenant of its class this tenant is."""
        key = (priority, tenant)
        floor = min(
            (self._counter[k] for k, n in self._active.items() if n and k[0] == priority), default=0.0
        )
        return self._counter[key] - floor
