"""One fan-out per gateway process: a single consumer tails ``chat.generations`` and
routes each event to the subscriptions of the requests waiting for it.

* Partitions are read on demand: a partition is added (at its current end, a
  concrete offset, so nothing produced afterwards is missed) when a request in it
  is followed, and dropped after ``linger_s`` without one. Records are filtered by
  key (conversation) before they are decoded, so a gateway pays little for the
  partitions' other conversations.
* Each subscription is bounded. While its reader lags, consecutive token deltas are
  merged into one; past ``max_items`` events or ``max_bytes`` of text it is dropped
  (the client resumes from its ``Last-Event-ID``), so a slow client never stalls others.
* Timing is swept, not timed per event: once a second the fan-out wakes readers that
  have had nothing for ``KEEPALIVE_S`` (a keep-alive is due) or whose deadline passed,
  so a delta costs its reader no timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.dependencies import from_log
from pipeline.codec import DecodeError, Position, decode
from pipeline.kafka import QUICK_ASSIGN, AsyncConsumer, Record
from pipeline.retry import QuietLog
from pipeline.topics import GENERATIONS
from schemas import GenerationEvent, TokenDelta

log = logging.getLogger(__name__)
# A reader that has had nothing for this long is woken to send a keep-alive (proxies
# close connections that stay silent), or to give up once its deadline has passed.
KEEPALIVE_S = 15.0
SWEEP_S = 1.0


@dataclass(frozen=True)
class Delivered:
    """A generation event and its position; a merged delta spans ``span`` seqs."""

    position: Position
    event: GenerationEvent
    span: int = 1


class Overflow(Exception):
    """The reader fell too far behind; its subscription was dropped."""


class Subscription:
    def __init__(self, request_id: str, key: bytes, partition: int, start: int,
                 max_items: int = 1000, max_bytes: int = 4_000_000) -> None:
        self.request_id = request_id
        self.key = key
        self.partition = partition
        self.start = start  # every event at or after this offset arrives through push()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.overflowed = False
        self.deadline: float | None = None  # monotonic: its reader gives up past it
        self.last_read = time.monotonic()  # when its reader last got something
        self._next_seq = 0  # after the highest token pushed
        self._items: deque[Delivered] = deque()
        self._bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._nudged = False

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Delivered) -> None:
        """Queue ``item``; consecutive deltas merge while the reader is behind. A delta
        already pushed (a worker that wrote it again) is dropped here: merged into
        a run with new ones, it would hide them from the reader's duplicate check."""
        if self.overflowed:
            return
        last = self._items[-1] if self._items else None
        new = item.event
        if isinstance(new, TokenDelta):
            if new.seq < self._next_seq:
                return
            self._next_seq = new.seq + 1
        if (last is not None and isinstance(last.event, TokenDelta)
                and isinstance(new, TokenDelta) and new.seq == last.event.seq + last.span):
            merged = last.event.model_copy(update={"text": last.event.text + new.text,
                                                   "token_ids": last.event.token_ids
                                                   + new.token_ids})
            self._items[-1] = Delivered(item.position, merged, last.span + 1)
        else:
            self._items.append(item)
        if isinstance(new, TokenDelta):
            self._bytes += len(new.text)
        if len(self._items) > self.max_items or self._bytes > self.max_bytes:
            log.warning("dropping the stream of %s: its reader is too slow", self.request_id)
            self.overflowed = True
            self._items.clear()
        self._wake()

    def nudge(self) -> None:
        """Wake the reader with nothing: a keep-alive is due, or its deadline passed."""
        self._nudged = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Delivered | None:
        """The next event; None when woken by ``nudge`` with nothing to read."""
        while not self._items:
            if self.overflowed:
                raise Overflow
            if self._nudged:
                self._nudged = False
                self.last_read = time.monotonic()
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item.event, TokenDelta):
            self._bytes -= len(item.event.text)
        self.last_read = time.monotonic()
        return item


class GenerationTail:
    def __init__(
        self, bootstrap: str, end_of: Callable[[int], Awaitable[int]], linger_s: float = 60.0,
        max_items: int = 1000, max_bytes: int = 4_000_000, timeout_s: float = 5.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._quiet = QuietLog(log)
        # Partitions are assigned, not subscribed: the group id is only a label.
        self._consumer = AsyncConsumer(bootstrap, f"gateway-tail-{uuid.uuid4().hex[:12]}",
                                       **QUICK_ASSIGN)
        self._end_of = end_of
        self._linger_s = linger_s
        self._limits = (max_items, max_bytes)
        self._subs: dict[str, set[Subscription]] = {}
        self._keys: Counter[bytes] = Counter()
        self._next: dict[int, int] = {}  # partition -> next offset to route
        self._users: Counter[int] = Counter()
        self._idle_since: dict[int, float] = {}
        self._adding = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def partitions(self) -> list[int]:
        return sorted(self._next)

    async def start(self) -> None:
        await self._consumer.call(self._consumer.partitions_sync, GENERATIONS)  # metadata
        self._task = asyncio.create_task(self._run(), name="generation-tail")

    async def follow(self, request_id: str, key: bytes, partition: int) -> Subscription:
        """Subscribe to a turn's events from the current end of its partition on."""
        await self._ensure(partition)
        sub = Subscription(request_id, key, partition, self._next[partition], *self._limits)
        self._subs.setdefault(request_id, set()).add(sub)
        self._keys[key] += 1
        self._users[partition] += 1
        self._idle_since.pop(partition, None)
        return sub

    def unfollow(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.request_id)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        if not subs:
            del self._subs[sub.request_id]
        self._keys[sub.key] -= 1
        if self._keys[sub.key] <= 0:
            del self._keys[sub.key]
        self._users[sub.partition] -= 1
        if self._users[sub.partition] <= 0:
            del self._users[sub.partition]
            self._idle_since[sub.partition] = time.monotonic()

    async def _ensure(self, partition: int) -> None:
        if partition in self._next:
            return
        async with self._adding:
            if partition in self._next:
                return
            end = await self._end_of(partition)
            self._next[partition] = end
            try:
                await from_log(self._consumer.call(self._consumer.add_partitions_sync,
                                                   {(GENERATIONS, partition): end}),
                               self._timeout_s)
            except BaseException:
                del self._next[partition]
                raise
        log.info("tailing %s/%d from %d", GENERATIONS, partition, end)

    def _sweep(self) -> None:
        """Nudge the readers due a keep-alive, and those past their deadline."""
        now = time.monotonic()
        for subs in self._subs.values():
            for sub in subs:
                if now - sub.last_read >= KEEPALIVE_S or (
                        sub.deadline is not None and now >= sub.deadline):
                    sub.nudge()

    async def _drop_idle(self) -> None:
        now = time.monotonic()
        idle = [p for p, since in self._idle_since.items() if now - since > self._linger_s]
        for p in idle:
            del self._idle_since[p]
            self._next.pop(p, None)
        if idle:
            await self._consumer.call(self._consumer.drop_partitions_sync,
                                      [(GENERATIONS, p) for p in idle])
            log.info("stopped tailing %s/%s", GENERATIONS, idle)

    def _route(self, record: Record) -> None:
        p = record.position.partition
        if p not in self._next:
            return  # dropped while this batch was in flight
        self._next[p] = record.position.offset + 1
        if record.key not in self._keys:
            return
        try:
            event = decode(record.value)
        except DecodeError:
            return  # the projector dead-letters it
        subs = self._subs.get(event.request_id)
        if subs and isinstance(event, GenerationEvent):
            item = Delivered(record.position, event)
            for sub in subs:
                sub.push(item)

    async def _run(self) -> None:
        last_sweep = time.monotonic()
        while True:
            sweep = time.monotonic() - last_sweep > SWEEP_S
            if sweep:  # also while Kafka is away
                last_sweep = time.monotonic()
                self._sweep()
            try:
                records = await self._consumer.poll_batch(1000, 0.05)
                for record in records:
                    self._route(record)
                if sweep:
                    await self._drop_idle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._quiet.warning("the generation tail could not read Kafka; retrying: %r",
                                    exc)
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.close()
