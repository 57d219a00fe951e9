"""The work a request costs before admission charges it: bounded per tenant, shared fairly.

Admission needs the prompt's exact token count, so a body is read, decoded and tokenized before any
quota is charged. Unbounded, that stage lets a tenant whose quota admits one request a minute send
thousands of 1 MB prompts and hold the gateway's memory, its RPC slots and the cores that tokenize
everyone's prompts. Two bounds close it:

- :class:`PreAdmission`: a tenant may have at most ``max_concurrent`` requests (its own concurrency
  quota) between authentication and admission; one more is refused at once (RESOURCE_EXHAUSTED,
  the concurrency quota named), before its body is read. A tenant without a concurrency quota is
  trusted and not bounded here.
- :class:`FairSlots`: large prompts are tokenized on a few worker threads; waiters are served one
  tenant at a time in turn, so a tenant with many queued prompts delays another tenant's prompt by at
  most one prompt's work per slot, whatever its queue holds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from gateway.errors import ErrorKind, GatewayError
from tenancy import Limit, Tenant

# What a client refused here waits before retrying: a request ahead of it is typically admitted
# (or refused) within this.
RETRY_AFTER_S = 1.0


class Ticket:
    """One request's place in its tenant's pre-admission bound; released once, by whoever is first."""

    def __init__(self, counts: dict[str, int] | None, tenant_id: str) -> None:
        self._counts = counts
        self._tenant_id = tenant_id

    def release(self) -> None:
        if self._counts is None:
            return
        left = self._counts[self._tenant_id] - 1
        if left:
            self._counts[self._tenant_id] = left
        else:
            del self._counts[self._tenant_id]
        self._counts = None


class PreAdmission:
    """Requests each tenant has between authentication and admission (one event loop's view)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def enter(self, tenant: Tenant) -> Ticket:
        """A ticket to release when the request is admitted or ends; RESOURCE_EXHAUSTED past the bound."""
        cap = tenant.quotas.max_concurrent
        if cap is None:
            return Ticket(None, tenant.id)
        held = self._counts.get(tenant.id, 0)
        if held >= cap:
            raise GatewayError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{Limit.CONCURRENCY} quota exhausted: {held} requests of this tenant are being "
                f"prepared for admission; retry in {RETRY_AFTER_S:g} s",
                retry_after_s=RETRY_AFTER_S,
                limit=str(Limit.CONCURRENCY),
            )
        self._counts[tenant.id] = held + 1
        return Ticket(self._counts, tenant.id)

    def held(self, tenant_id: str) -> int:
        return self._counts.get(tenant_id, 0)


class FairSlots:
    """``slots`` places, granted to waiting tenants in turn (round robin), FIFO within a tenant."""

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = (
            collections.OrderedDict()
        )

    @contextlib.asynccontextmanager
    async def slot(self, tenant_id: str) -> AsyncIterator[None]:
        await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, tenant_id: str) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant_id, collections.deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as it was cancelled: pass it on
                self._release()
            else:
                self._forget(tenant_id, granted)
            raise

    def _release(self) -> None:
        while self._waiting:
            tenant_id, queue = next(iter(self._waiting.items()))
            granted = queue.popleft()
            del self._waiting[tenant_id]
            if queue:  # this tenant's next waiter goes to the back of the turn
                self._waiting[tenant_id] = queue
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1

    def _forget(self, tenant_id: str, granted: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant_id)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(granted)
        if not queue:
            del self._waiting[tenant_id]

    def waiting(self, tenant_id: str) -> int:
        return len(self._waiting.get(tenant_id, ()))
