"""Each tenant's share of a replica's KV blocks: the floor it keeps, the cap it may not pass, and the
weighted fair share that decides whom a preemption falls on.

Admins set floor and cap as fractions of the pool (``KvShare``), so one setting fits replicas of
any size. A tenant's share is remembered after its last request ends: its floor keeps protecting its
prefix-cache entries while it is idle, which is the point for a quiet tenant beside a busy one. If
the floors of the tenants a replica has seen add up to more than the pool, each is scaled down in
proportion, so together they never promise more blocks than there are.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.requests import KvShare

_ANYONE = KvShare()


class KvShares:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._share: dict[str, KvShare] = {}
        self._weight: dict[str, float] = {}
        self._floor_scale = 1.0

    def update(self, tenant: str, share: KvShare, weight: float) -> None:
        """What the newest request of ``tenant`` carried (an admin's change reaches the next one)."""
        self._weight[tenant] = weight
        if self._share.get(tenant, _ANYONE) != share:
            self._share[tenant] = share
            total = sum(s.floor for s in self._share.values())
            self._floor_scale = 1.0 if total <= 1.0 else 1.0 / total

    def tenants(self) -> list[str]:
        return list(self._share)

    def floor(self, tenant: str) -> int:
        return int(self._share.get(tenant, _ANYONE).floor * self._floor_scale * self.num_blocks)

    def cap(self, tenant: str) -> int:
        return max(1, int(self._share.get(tenant, _ANYONE).cap * self.num_blocks))

    def fair(self, tenant: str, tenants: Iterable[str]) -> float:
        """Blocks ``tenant`` is due among ``tenants`` (those holding or asking for blocks): the pool
        split by weight, but never below its floor nor above its cap."""
        weights = {t: self._weight.get(t, 1.0) for t in tenants}
        weights.setdefault(tenant, self._weight.get(tenant, 1.0))
        due = self.num_blocks * weights[tenant] / sum(weights.values())
        return min(max(due, self.floor(tenant)), self.cap(tenant))
