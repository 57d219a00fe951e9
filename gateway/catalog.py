"""Which pool serves which model, with the tokenizer the gateway counts and encodes prompts with.

Prompts are tokenized here, not in the engine, so admission reserves exact prompt tokens before any
replica is involved, and a prompt too long for the model is refused without a round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engine_pool import EnginePool
from gateway.errors import ErrorKind, GatewayError
from protocol.tokenizer import Tokenizer
from tenancy import Tenant


@dataclass(frozen=True)
class ModelRoute:
    model: str
    pool: EnginePool
    context_length: int
    tokenizer: Tokenizer


class ModelCatalog:
    def __init__(self, routes: list[ModelRoute]) -> None:
        self._routes = {(r.pool.name, r.model): r for r in routes}

    @classmethod
    async def build(cls, pools: list[tuple[EnginePool, Tokenizer]]) -> ModelCatalog:
        """Ask each pool what model it serves; each comes with that model's tokenizer."""
        routes = []
        for pool, tokenizer in pools:
            info = await pool.describe()
            routes.append(ModelRoute(info.model, pool, info.context_length, tokenizer))
        return cls(routes)

    @property
    def routes(self) -> list[ModelRoute]:
        return list(self._routes.values())

    def visible_to(self, tenant: Tenant) -> list[ModelRoute]:
        return [
            r
            for (pool, _), r in self._routes.items()
            if pool == tenant.pool_name and tenant.allows_model(r.model)
        ]

    def route(self, tenant: Tenant, model: str) -> ModelRoute:
        pool = tenant.pool_name
        route = self._routes.get((pool, model))
        if route is not None:
            return route
        if not any(p == pool for p, _ in self._routes):
            raise GatewayError(ErrorKind.UNAVAILABLE, f"the {pool!r} pool of this tenant is not deployed")
        # Only what this tenant may use is named: the rest of the pool is none of its business.
        served = sorted(m for p, m in self._routes if p == pool and tenant.allows_model(m))
        available = ", ".join(served) or "none"
        raise GatewayError(ErrorKind.NOT_FOUND, f"model {model!r} is not served here; available: {available}")
