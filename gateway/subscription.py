"""A follower's queue of one turn's stream items (``Subscription``), fed by the
process's fan-out (``gateway.tail``), and the items as they go to clients
(``Delivered``).

Each subscription is bounded. While its reader lags, consecutive deltas are merged
into one (once its reader has said which it has: ``hand_off``); past ``max_items``
items or ``max_bytes`` of text it is dropped (the client resumes from its
``Last-Event-ID``), so a slow client never stalls others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeVar

from pipeline.codec import Position
from pipeline.kafka import Record
from schemas import GenerationEvent, TokenDelta
from schemas.live import Delta, StreamItem, from_event

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivered:
    """One item of a turn's stream, and where it is in the log: a live record's offset
    and the entry's ``index`` in it, or (``index`` None) a ``chat.generations`` event's
    offset. ``position`` None: an item made from the durable record's end, standing for
    no entry (a turn sent whole once its live entries are gone). A merged delta spans
    ``span`` seqs."""

    position: Position | None
    item: StreamItem
    index: int | None = None
    span: int = 1

    @property
    def key(self) -> tuple[str, int, int] | None:
        """Where a client that received this resumes from (``gateway.ids``)."""
        if self.position is None:
            return None
        return self.position.topic, self.position.offset, self.index or 0


def legacy(record: Record, event: GenerationEvent) -> Delivered | None:
    """A ``chat.generations`` event as a stream item, if it is one of a turn written
    before the live stream (a start or an end since then stands in ``chat.live`` too)."""
    if not isinstance(event, TokenDelta) and event.ref is not None:
        return None
    item = from_event(event)
    return Delivered(record.position, item) if item is not None else None


K = TypeVar("K", bound=Hashable)


def release(counts: dict[K, int], key: K) -> bool:
    """One fewer of ``key`` in ``counts``, dropped at none: whether it is gone (a count
    per key in flight that must not keep keys no longer used)."""
    counts[key] -= 1
    if counts[key] > 0:
        return False
    del counts[key]
    return True


class Overflow(Exception):
    """The reader fell too far behind; its subscription was dropped."""


class Subscription:
    def __init__(self, request_id: str, key: bytes, partition: int,
                 starts: dict[str, int] | None = None, ref: int | None = None,
                 max_items: int = 1000, max_bytes: int = 4_000_000,
                 held: bool = False) -> None:
        self.request_id = request_id
        self.key = key
        self.partition = partition
        # Per tailed topic, the offset from which every record arrives through push()
        # (and none before it: the log is read up to there).
        self.starts = starts or {}
        # Its reader first gets the turn's items up to ``starts`` from the log: deltas
        # are merged only once it is known which it has (``hand_off``).
        self.held = held
        self.ref = ref  # the turn's reference in chat.live, once known
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.overflowed = False
        self.deadline: float | None = None  # monotonic: its reader gives up past it
        self.last_read = time.monotonic()  # when its reader last got something
        self._next_seq = 0  # after the highest delta pushed
        self._items: deque[Delivered] = deque()
        self._bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._nudged = False
        # The first live record it got: when the worker wrote it (the record's time, ms)
        # and when this gateway read it (ns): a trace's delta hop.
        self.first_live: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Delivered) -> None:
        """Queue ``item``; consecutive deltas merge while the reader is behind. A delta
        already pushed (a worker that wrote it again) is dropped here: merged into a run
        with new ones, it would hide them from the reader's duplicate check."""
        if self.overflowed:
            return
        new = item.item
        if isinstance(new, Delta):
            if new.seq < self._next_seq:
                return
            self._next_seq = new.seq + 1
            self._bytes += len(new.text)
        last = self._items[-1] if self._items and not self.held else None
        if (last is not None and isinstance(last.item, Delta) and isinstance(new, Delta)
                and new.seq == last.item.seq + last.span):
            merged = Delta(last.item.seq, last.item.text + new.text,
                           last.item.token_ids + new.token_ids)
            self._items[-1] = Delivered(item.position, merged, item.index, last.span + 1)
        else:
            self._items.append(item)
        if len(self._items) > self.max_items or self._bytes > self.max_bytes:
            log.warning("dropping the stream of %s: its reader is too slow", self.request_id)
            self.overflowed = True
            self._items.clear()
        self._wake()

    def hand_off(self, next_seq: int) -> None:
        """Its reader has every delta below ``next_seq`` (read from the log): those queued
        are dropped, and consecutive deltas merge from now on. Merged before, a delta it
        has and one it lacks would be one item, taken for a duplicate whole."""
        self._next_seq = max(self._next_seq, next_seq)
        self._items = deque(d for d in self._items
                            if not isinstance(d.item, Delta) or d.item.seq >= next_seq)
        self._bytes = sum(len(d.item.text) for d in self._items if isinstance(d.item, Delta))
        self.held = False

    def nudge(self) -> None:
        """Wake the reader with nothing: a keep-alive is due, or its deadline passed."""
        self._nudged = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Delivered | None:
        """The next item; None when woken by ``nudge`` with nothing to read."""
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
        if isinstance(item.item, Delta):
            self._bytes -= len(item.item.text)
        self.last_read = time.monotonic()
        return item
