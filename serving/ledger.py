"""The pool's service ledger as a Ray actor: one per deployment, found by name, created by whichever
replica asks first (serving/pool_ledger.py holds the arithmetic)."""

from __future__ import annotations

from typing import cast

import ray
from ray.actor import ActorHandle

from serving.pool_ledger import Key, PoolLedger


class _LedgerActor:
    def __init__(self) -> None:
        self._ledger = PoolLedger()

    def report(self, replica: str, served: dict[Key, float]) -> dict[Key, float]:
        return self._ledger.report(replica, served)


_Ledger = ray.remote(num_cpus=0)(_LedgerActor)


def pool_ledger(name: str) -> ActorHandle[_LedgerActor]:
    """The ledger of the deployment ``name`` (its replicas share fair-share service through it)."""
    options = _Ledger.options(name=f"loom-ledger:{name}", namespace="loom", get_if_exists=True)
    return cast("ActorHandle[_LedgerActor]", options.remote())
