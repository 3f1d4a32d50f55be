"""Which waiting prompt a worker starts next: a token-weighted fair share between
tenants, after the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024), instead of the log's order.

Each tenant has a counter of the service it has had: its turns' prompt tokens, and
their generated tokens at ``OUTPUT_COST`` each (a generated token costs a step; a
prompt's are taken many to a step), divided by its weight. A free slot goes to the
oldest waiting prompt of the tenant with the least counter. A tenant that had nothing
waiting has its counter lifted to the least counter of those that did, so service it
did not ask for is not banked: a tenant that comes back after an hour idle gets its
share from then on, not the hour's. Within a tenant, prompts start in the order they
were read, so a conversation's turns keep their order.

**Slots are taken back** (``preempt``, the default). A tenant's share of the slots is
``slots`` times its weight over the weights of the tenants with turns waiting or
running. While a tenant runs fewer turns than its share and has one waiting, it is
*starved*: a free slot goes to a starved tenant first, and when none is free
``victim()`` names the tenant furthest above its share, one of whose turns the worker
stops and puts back at the head of that tenant's queue (``requeue``), to continue later
after what it wrote (``workers.worker``). A tenant is only taken from while it keeps at
least its share afterwards, so two tenants never take a slot back and forth. Alone, a
tenant's share is every slot: nothing is taken back, and one tenant's throughput is the
log order's.

A tenant's running turns can also be capped (``max_running``) below its share.

``fair=False`` starts them in the order they were read instead (the log's order, as
before the fair share; ``WORKER_SCHEDULING=fifo``), caps still applied, and never takes
a slot back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
# The idle tenants whose counters are kept (the most recently idle). An older one's
# counter is forgotten: back, it starts from the least counter of the active tenants, as
# any tenant back from idle at or below that counter does. A worker's memory is then
# bounded by its load, not by how many tenants it has ever served.
IDLE_REMEMBERED = 10_000
# What one generated token adds to its tenant's counter, against one prompt token.
OUTPUT_COST = 2.0


class FairQueue(Generic[T]):
    """Waiting items by tenant (see the module). ``tenant_of`` names an item's tenant."""

    def __init__(self, tenant_of: Callable[[T], str], weights: dict[str, float] | None = None,
                 max_running: int | None = None, size_of: Callable[[T], int] = lambda _: 0,
                 fair: bool = True, slots: int | None = None) -> None:
        self.fair = fair
        # The slots shared (None: none is ever taken back).
        self.slots = slots if fair else None
        self._tenant_of = tenant_of
        self._size_of = size_of
        self.size = 0  # of the waiting items, as ``size_of`` counts
        self.weights = weights or {}
        self.max_running = max_running
        self._waiting: dict[str, deque[tuple[int, T]]] = {}  # (read order, item)
        self._read = 0
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}  # turns started and not yet ended
        self._idle: dict[str, None] = {}  # tenants with a counter and no turn, oldest first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[T]:
        for items in self._waiting.values():
            yield from (item for _, item in items)

    def push(self, item: T) -> None:
        tenant = self._tenant_of(item)
        queue = self._waiting.get(tenant)
        if queue is None:
            self._idle.pop(tenant, None)
            queue = self._waiting[tenant] = deque()
            # Back from idle (or new): no credit for the time it asked for nothing.
            if self.running.get(tenant, 0) == 0:
                active = {*self._waiting, *self.running} - {tenant}
                floor = min((self.counters.get(t, 0.0) for t in active), default=0.0)
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        queue.append((self._read, item))
        self._read += 1
        self._count += 1
        self.size += self._size_of(item)

    def pop(self) -> T | None:
        """The next item to start (counted as running), or None: nothing waits, or every
        tenant that waits is at its cap."""
        best, least = None, math.inf
        starved = self.starved()
        for tenant in starved or self._waiting:
            if self._capped(tenant):
                continue
            counter = (self.counters.get(tenant, 0.0) if self.fair
                       else self._waiting[tenant][0][0])
            if counter < least:
                best, least = tenant, counter
        if best is None:
            return None
        queue = self._waiting[best]
        _, item = queue.popleft()
        if not queue:
            del self._waiting[best]
        self._count -= 1
        self.size -= self._size_of(item)
        self.running[best] = self.running.get(best, 0) + 1
        return item

    def _capped(self, tenant: str) -> bool:
        return self.max_running is not None and self.running.get(tenant, 0) >= self.max_running

    def shares(self) -> dict[str, float]:
        """Each active tenant's share of the slots (none when slots are not shared)."""
        if self.slots is None:
            return {}
        active = {*self._waiting, *self.running}
        total = sum(self.weights.get(t, 1.0) for t in active)
        return {t: self.slots * self.weights.get(t, 1.0) / total for t in active}

    def starved(self) -> list[str]:
        """The tenants with a turn waiting that run fewer than their share."""
        shares = self.shares()
        return [t for t in self._waiting
                if shares and self.running.get(t, 0) < shares[t] and not self._capped(t)]

    def victim(self) -> str | None:
        """The tenant one of whose running turns to stop for a starved tenant (see the
        module), or None: none is starved, or none would keep its share."""
        if not self.starved():
            return None
        shares = self.shares()
        best, most = None, 0.0
        for tenant, running in self.running.items():
            above = running - shares[tenant]
            if above >= 1 and above > most:
                best, most = tenant, above
        return best

    def requeue(self, item: T) -> None:
        """A running item stopped to give its slot up (``ended`` was called for it when it
        was stopped): first of its tenant's to start again."""
        tenant = self._tenant_of(item)
        self._waiting.setdefault(tenant, deque()).appendleft((-1, item))
        self._count += 1
        self.size += self._size_of(item)

    def ended(self, tenant: str) -> None:
        """A turn of ``tenant`` that ``pop`` gave has ended (or was given up)."""
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)
            self._idled(tenant)

    def served(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add what ``tenant`` was served to its counter."""
        cost = prompt_tokens + OUTPUT_COST * output_tokens
        if cost:
            self.counters[tenant] = (self.counters.get(tenant, 0.0)
                                     + cost / self.weights.get(tenant, 1.0))
            self._idled(tenant)

    def _idled(self, tenant: str) -> None:
        """``tenant`` may have nothing waiting or running now: if so, it is the most
        recently idle, and the counter of the oldest idle past ``IDLE_REMEMBERED`` goes."""
        if tenant in self._waiting or tenant in self.running:
            return
        self._idle.pop(tenant, None)
        self._idle[tenant] = None
        while len(self._idle) > IDLE_REMEMBERED:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            self.counters.pop(oldest, None)

    def load(self) -> dict[str, tuple[int, int]]:
        """Per tenant with any: its items waiting, and running."""
        return {t: (len(self._waiting.get(t, ())), self.running.get(t, 0))
                for t in {*self._waiting, *self.running}}

    def remove(self, drop: Callable[[T], bool]) -> None:
        """Forget the waiting items ``drop`` says to (their partitions were handed on)."""
        for tenant in list(self._waiting):
            kept = deque(entry for entry in self._waiting[tenant] if not drop(entry[1]))
            self._count -= len(self._waiting[tenant]) - len(kept)
            self.size -= sum(self._size_of(item) for _, item in self._waiting[tenant]
                             if drop(item))
            if kept:
                self._waiting[tenant] = kept
            else:
                del self._waiting[tenant]
