"""Recalls shared fairly between tenants.

A recall embeds its query on the service's one engine, then searches the user's
memories on the service's pool of connections. Taken in the order they came, one
tenant's 200 recalls at once made every other tenant's wait behind them (4.3 s for a
first token). Here at most ``concurrent`` recalls run at once; the others wait in a
queue per tenant of at most ``per_tenant`` (one more is refused: ``TenantBusy``, a 429
at the gateway), and a freed place goes to the next tenant in turn: a tenant with one
recall waits for one place to free, however many another has waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class TenantBusy(Exception):
    """The tenant has as many recalls waiting as it may."""


class Recalls:
    def __init__(self, concurrent: int = 8, per_tenant: int = 32) -> None:
        self.concurrent, self.per_tenant = concurrent, per_tenant
        self.running = 0
        # Waiting recalls by tenant, in the order tenants are served next.
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @contextlib.asynccontextmanager
    async def place(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of the places while the recall runs (see the module)."""
        if self.running < self.concurrent and not self._queues:
            self.running += 1
        else:
            queue = self._queues.setdefault(tenant, deque())
            if len(queue) >= self.per_tenant:
                if not queue:
                    del self._queues[tenant]
                raise TenantBusy(f"{len(queue)} recalls of this tenant wait already "
                                 "(MEMORY_MAX_WAITING_RECALLS_PER_TENANT)")
            given: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queue.append(given)
            try:
                await given  # the place is handed over counted: ``running`` stays
            except asyncio.CancelledError:
                if given.done() and not given.cancelled():
                    self._hand_on()  # it was given the place as it left: pass it on
                else:
                    self._forget(tenant, given)
                raise
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        """A place freed: to the next tenant's oldest recall, in turn."""
        while self._queues:
            tenant, queue = next(iter(self._queues.items()))
            given = queue.popleft()
            if queue:
                self._queues.move_to_end(tenant)
            else:
                del self._queues[tenant]
            if not given.done():
                given.set_result(None)
                return
        self.running -= 1

    def _forget(self, tenant: str, given: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant)
        if queue is not None and given in queue:
            queue.remove(given)
            if not queue:
                del self._queues[tenant]
