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

A tenant's running turns can also be capped (``max_running``), so that it cannot hold
every slot of the batch: a worker cannot take a slot back from a turn that runs, and
without a cap one tenant's long turns started before another's arrived hold the batch
until they end (the fair share then gives the other every slot that frees).

``fair=False`` starts them in the order they were read instead (the log's order, as
before the fair share; ``WORKER_SCHEDULING=fifo``), caps still applied.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
# What one generated token adds to its tenant's counter, against one prompt token.
OUTPUT_COST = 2.0


class FairQueue(Generic[T]):
    """Waiting items by tenant (see the module). ``tenant_of`` names an item's tenant."""

    def __init__(self, tenant_of: Callable[[T], str], weights: dict[str, float] | None = None,
                 max_running: int | None = None, size_of: Callable[[T], int] = lambda _: 0,
                 fair: bool = True) -> None:
        self.fair = fair
        self._tenant_of = tenant_of
        self._size_of = size_of
        self.size = 0  # of the waiting items, as ``size_of`` counts
        self.weights = weights or {}
        self.max_running = max_running
        self._waiting: dict[str, deque[tuple[int, T]]] = {}  # (read order, item)
        self._read = 0
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}  # turns started and not yet ended
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
        for tenant in self._waiting:
            if self.max_running is not None and self.running.get(tenant, 0) >= self.max_running:
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

    def ended(self, tenant: str) -> None:
        """A turn of ``tenant`` that ``pop`` gave has ended (or was given up)."""
        left = self.running.get(tenant, 0) - 1
        if left > 0:
            self.running[tenant] = left
        else:
            self.running.pop(tenant, None)

    def served(self, tenant: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Add what ``tenant`` was served to its counter."""
        cost = prompt_tokens + OUTPUT_COST * output_tokens
        if cost:
            self.counters[tenant] = (self.counters.get(tenant, 0.0)
                                     + cost / self.weights.get(tenant, 1.0))

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
