"""What a ``TransactionalProducer`` has queued for its next transaction (``Outbox``):
the records' epochs, the spacing of transactions, and backpressure on the senders.

Senders on an event loop put records in; the transaction loop
(``pipeline.kafka.transaction_loop``) takes them a transaction at a time; the watchdog
(``pipeline.kafka.watchdog``) answers those whose deadline passed. All three share the
outbox's lock (``cond``), which also guards the open transaction's state in the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

from pipeline.codec import Position
from pipeline.kafka.client import RECORD_OVERHEAD, Fenced, ProduceError, RecordTooLarge, resolve

log = logging.getLogger(__name__)


@dataclass
class Queued:
    """A record waiting for its transaction, and its sender's answer."""

    epoch: int
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]
    future: asyncio.Future[Position] | None
    deadline: float | None = None  # time.monotonic(): answered NotAccepted after this
    partition: int | None = None  # None: the key's
    position: Position | None = None  # where it landed (set by its delivery report)
    settled: bool = False  # its sender has had the answer
    refused: KafkaError | None = None  # the broker refused this record itself (its size)

    def late(self, now: float) -> bool:
        return self.deadline is not None and self.deadline < now and not self.settled

    @property
    def size(self) -> int:
        """Its bytes as a record limit counts them (less the batch's own overhead)."""
        return (len(self.value or b"") + len(self.key or b"")
                + sum(len(k) + len(v or b"") for k, v in self.headers))


class NotAccepted(ProduceError):
    """A record whose deadline passed before its transaction asked to commit: that
    transaction is aborted, never committed, so the record is never visible."""


@dataclass(frozen=True)
class RecordLimits:
    """The largest record each topic takes (its max.message.bytes, as read from the
    cluster, batch overhead included); the others, ``default``."""

    default: int
    topics: dict[str, int] = field(default_factory=dict)

    def of(self, topic: str) -> int:
        """``topic``'s own limit, batch overhead included."""
        return self.topics.get(topic, self.default)

    def record(self, topic: str) -> int:
        """The largest record (key, value and headers) ``topic`` takes."""
        return self.of(topic) - RECORD_OVERHEAD


@dataclass(frozen=True)
class Pacing:
    """How transactions are spaced: ``interval_s`` apart at least, and, for a sender that
    ``gathers``, begun once it says its step is in (see ``TransactionalProducer``)."""

    interval_s: float = 0.0
    gathers: bool = False


class Outbox:
    """The records queued for the next transaction (see the module)."""

    def __init__(self, limits: RecordLimits, pacing: Pacing, max_queued: int) -> None:
        self.cond = threading.Condition()  # reentrant: the loop nests its own sections
        self.limits = limits
        self._pacing = pacing
        # Records queued past this bound make ``room()`` wait until a transaction takes them.
        self._max_queued = max_queued
        self._items: list[Queued] = []
        self.epoch = 0
        self.failed: BaseException | None = None  # the producer failed for good
        self.busy = False  # the loop holds a batch: a transaction is being made
        self._last_began = 0.0  # when the latest transaction began (monotonic)
        self._gathered = False
        self._first_queued = 0.0  # when the oldest queued record was queued (monotonic)
        self._roomy: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        # Senders holding their records until the transaction being made is over.
        self._free_waiters: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._commit_wanted = False
        self._stop = False

    # The senders' side.

    def put(self, items: list[Queued]) -> None:
        """Queue ``items``, answering at once those that can never be written."""
        with self.cond:
            for item in items:
                if self.failed is not None:
                    settle(item, ProduceError(f"the producer failed: {self.failed}"))
                elif item.epoch < self.epoch:
                    settle(item, Fenced("written for turns this worker gave up"))
                elif item.size > self.limits.record(item.topic):
                    refuse(item, RecordTooLarge(item.topic, item.size,
                                                self.limits.of(item.topic)))
            items = [item for item in items if not item.settled]
            if not items:
                return
            self._items += items
            if len(self._items) == len(items):  # the transaction loop waits for a first one
                self._first_queued = time.monotonic()
                self.cond.notify_all()

    def gathered(self) -> None:
        """What the sender has to write for now is queued (``Pacing.gathers``)."""
        with self.cond:
            if self._items and not self._gathered:
                self._gathered = True
                self.cond.notify_all()

    def begins_in(self) -> float | None:
        """How long before a transaction may take what is queued now: None while one is
        being made, else what is left of the spacing since the latest began (0: at once)."""
        with self.cond:
            if self.busy:
                return None
            return max(self._last_began + self._pacing.interval_s - time.monotonic(), 0.0)

    def when_free(self, callback: Callable[[], None]) -> bool:
        """Have ``callback`` called on the running event loop once the transaction being
        made is over (or the outbox stops); False, and no call, if none is being made."""
        with self.cond:
            if not self.busy or self._stop:
                return False
            self._free_waiters.append((asyncio.get_running_loop(), callback))
            return True

    @property
    def backlogged(self) -> bool:
        """More records queued than ``max_queued`` (the log takes them slower than they
        come): a sender that can wait should (``room``)."""
        return len(self._items) >= self._max_queued

    async def room(self) -> None:
        """Wait until the queue is under its bound: the next transaction took what waited,
        or it was dropped."""
        while True:
            with self.cond:
                if not self.backlogged:
                    return
                if self._roomy is None:
                    self._roomy = (asyncio.get_running_loop(), asyncio.Event())
                event = self._roomy[1]
            await event.wait()

    def want_commit(self, unless_within_s: float = 0.0) -> None:
        """A transaction is wanted even if nothing is queued (offsets to commit), unless
        one began within ``unless_within_s``: a sender that asks again that often leaves
        its offsets to the transactions it writes anyway while it writes, and asks for
        one of their own once it has been quiet that long."""
        with self.cond:
            if time.monotonic() - self._last_began < unless_within_s:
                return
            self._commit_wanted = True
            self.cond.notify_all()

    def new_epoch(self) -> int:
        """Drop every record not yet in a transaction; later ones need the new epoch."""
        with self.cond:
            self.epoch += 1
            dropped, self._items, self._gathered = self._items, [], False
            self._emptied()
        for item in dropped:
            settle(item, Fenced("written for turns this worker gave up"))
        return self.epoch

    def flush_sync(self, timeout: float) -> bool:
        """Block until everything queued so far has been committed or dropped."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self._items or self.busy:
                if self.failed is not None or not self.cond.wait(deadline - time.monotonic()):
                    return False
        return True

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
            self._freed()

    # The transaction loop's side.

    def next_batch(self, current: Callable[[], bool]) -> list[Queued] | None:
        """Wait until a transaction may begin, then take its records (answering those
        that may not go in it: an older epoch's, the late). None once the loop is to
        end: stopped with nothing left, or no longer ``current`` (abandoned)."""
        while True:
            with self.cond:
                while not self._items and not self._commit_wanted and not self._stop:
                    self.cond.wait()
                while not self._stop and (wait := self._may_begin(time.monotonic())):
                    self.cond.wait(wait)  # what is queued meanwhile joins this transaction
                if not current():
                    return None
                if not self._items and not self._commit_wanted:
                    if self._stop:
                        return None
                    continue  # dropped meanwhile (``new_epoch``): wait for the next
                now = time.monotonic()
                stale = [q for q in self._items if q.epoch != self.epoch]
                batch = [q for q in self._items if q.epoch == self.epoch and not q.late(now)]
                late = [q for q in self._items if q.late(now)]
                self._items, self.busy, self._commit_wanted = [], True, False
                self._gathered = False
                self._emptied()
            for item in stale:
                settle(item, Fenced("written for turns this worker gave up"))
            for item in late:
                settle(item, NotAccepted("the log did not take it in time"))
            return batch

    def began(self, now: float) -> None:
        """(Holding the lock.) A transaction began: the next is spaced from now."""
        self._last_began = now

    def give_back(self, batch: list[Queued]) -> None:
        """(Holding the lock.) ``batch`` is no longer in a transaction; those of it still
        owed an answer go before anything queued since, in the order they were sent."""
        self._items[:0] = [q for q in batch if q.epoch == self.epoch and not q.settled]
        self.busy = False
        self.cond.notify_all()
        self._freed()

    # The watchdog's side.

    def take_late(self, now: float) -> list[Queued]:
        """(Holding the lock.) The queued records past their deadline, taken out."""
        late = [q for q in self._items if q.late(now)]
        if late:
            self._items = [q for q in self._items if not q.late(now)]
        return late

    @property
    def drained(self) -> bool:
        """Stopped, with nothing queued or in a transaction."""
        return self._stop and not self.busy and not self._items

    def _may_begin(self, now: float) -> float:
        """(Holding the lock.) 0 if a transaction may begin now, else how long to wait."""
        interval = self._pacing.interval_s
        wait = self._last_began + interval - now
        if wait > 0:
            return wait
        if not self._pacing.gathers or self._gathered or not self._items:
            return 0.0
        return max(self._first_queued + interval - now, 0.0)

    def _freed(self) -> None:
        """(Holding the lock.) Call back the senders waiting for the transaction to end."""
        waiters, self._free_waiters = self._free_waiters, []
        for loop, callback in waiters:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(callback)

    def _emptied(self) -> None:
        """(Holding the lock, the queue just emptied.) Wake whoever waits for room."""
        if self._roomy is not None:
            loop, event = self._roomy
            self._roomy = None
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(event.set)


def refuse(item: Queued, error: RecordTooLarge) -> None:
    """Answer a record refused for itself; one nobody waits for is said in the log."""
    if item.future is None:
        log.error("a record for %s was dropped: %s", item.topic, error)
    settle(item, error)


def settle(item: Queued, error: BaseException | None) -> None:
    """Answer the sender, once."""
    if item.settled:
        return
    item.settled = True
    future = item.future
    if future is None:
        return
    loop = future.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(resolve, future,
                              error if error is not None else item.position or Position("", 0, 0))
