"""``LogReader``: a consumer outside any group's assignment that reads the log where it
is told: partitions from their start or their end, exact positions, ranges, offsets by
time. Its blocking calls run on its own thread (``AsyncConsumer``).

Its calls share that thread, so a read its caller gave up on (a timeout, a request
cancelled) would hold it, and every read queued behind, until its own deadline: an
awaited read (``read_range``, ``read_at``) is told when its caller stops waiting, and
stops at its next poll (a fifth of a second at most)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from confluent_kafka import TopicPartition

from pipeline.codec import TP
from pipeline.kafka.client import Record, poll_records
from pipeline.kafka.consumer import AsyncConsumer

T = TypeVar("T")
# How long a read polls at once: what a read told to stop may go on for.
POLL_S = 0.2


class GaveUp(Exception):
    """A read stopped because its caller no longer waits for it."""


class LogReader(AsyncConsumer):
    """Reads partitions it assigns itself (its group id names it; it commits nothing)."""

    def assign_partitions_sync(self, partitions: list[TP]) -> dict[TP, int]:
        """Read ``partitions`` from their start up to the end they have now; return the
        ends of those that hold anything."""
        ends: dict[TP, int] = {}
        starts = []
        for topic, p in partitions:
            low, high = self.watermarks_sync(topic, p)
            if high > low:
                ends[(topic, p)] = high
                starts.append(TopicPartition(topic, p, low))
        self._consumer.assign(starts)
        return ends

    def assign_at_sync(self, starts: dict[TP, int]) -> None:
        """Read these partitions (only) from these offsets."""
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in starts.items()])

    def assign_from_start_sync(self, topics: list[str]) -> dict[TP, int]:
        """Every partition of ``topics``, as ``assign_partitions_sync``."""
        return self.assign_partitions_sync(
            [(t, p) for t in topics for p in self.partitions_sync(t)])

    def add_partitions_sync(self, starts: dict[TP, int]) -> None:
        """Also read these partitions, each from the given offset (the rest keep their
        place), fetching them at once: the fetcher is woken (see ``resume_sync``) when
        nothing else was read; else it is fetching already, a long poll in flight, which
        the wake-up's request would wait behind on the same connection (a gateway's add
        of a partition to follow took the poll's 10 ms for it, measured), and the added
        partitions join the next fetch. One read already is read again from its offset,
        with new fetch state: an earlier add that its caller stopped waiting for (a
        timeout) went through all the same, and librdkafka refuses to assign a partition
        twice. A pause left from an earlier assignment is lifted."""
        partitions = [TopicPartition(t, p, o) for (t, p), o in starts.items()]
        read = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        again = [TopicPartition(t, p) for t, p in starts if (t, p) in read]
        if again:
            self._consumer.incremental_unassign(again)
        self._consumer.incremental_assign(partitions)
        self._consumer.resume(partitions)
        if not read - set(starts):
            self._wake_fetcher(partitions)

    def follow_from_end_sync(self, topic: str) -> None:
        """Read every partition of ``topic`` from the end it has now on."""
        self.add_partitions_sync({(topic, p): self.watermarks_sync(topic, p)[1]
                                  for p in self.partitions_sync(topic)})

    def drop_partitions_sync(self, partitions: list[TP]) -> None:
        self._consumer.incremental_unassign([TopicPartition(t, p) for t, p in partitions])

    def read_range_sync(
        self, topic: str, partition: int, start: int, end: int, timeout: float = 30.0,
        stop: threading.Event | None = None,
    ) -> list[Record]:
        """The records of one partition from ``start`` up to (not including) ``end``;
        ``GaveUp`` once ``stop`` is set."""
        if start >= end:
            return []
        tp = TopicPartition(topic, partition, start)
        self._consumer.assign([tp])
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                _check(stop)
                batch = poll_records(self._consumer, 5000, POLL_S)
                records += [r for r in batch if r.position.offset < end]
                if batch and batch[-1].position.offset + 1 >= end:
                    return records
                if not batch and self._consumer.position([tp])[0].offset >= end:
                    return records  # the range ends in offsets that hold no record
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {topic}/{partition} [{start}, {end}) timed out")
        finally:
            self._consumer.unassign()

    def read_at_sync(self, wanted: Sequence[tuple[str, int, int]], timeout: float = 30.0,
                     stop: threading.Event | None = None
                     ) -> dict[tuple[str, int, int], Record | None]:
        """The records at these exact positions (topic, partition, offset), read at once;
        None for a position that holds no committed record (an aborted one, a marker, or
        one the topic no longer keeps). ``GaveUp`` once ``stop`` is set."""
        todo = {(t, p): o for t, p, o in wanted}
        if len(todo) != len(set(wanted)):
            raise ValueError("read_at_sync reads one offset per partition")
        found: dict[tuple[str, int, int], Record | None] = dict.fromkeys(wanted)
        if not todo:
            return found
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in todo.items()])
        deadline = time.monotonic() + timeout
        try:
            while todo:
                _check(stop)
                for record in poll_records(self._consumer, 100, POLL_S):
                    pos = record.position
                    want = todo.get((pos.topic, pos.partition))
                    if want is None or pos.offset < want:
                        continue
                    if pos.offset == want:
                        found[(pos.topic, pos.partition, want)] = record
                    del todo[(pos.topic, pos.partition)]
                for tp in self._consumer.position(
                        [TopicPartition(t, p) for t, p in list(todo)]):
                    if (tp.topic, tp.partition) in todo and tp.offset > todo[(tp.topic,
                                                                              tp.partition)]:
                        del todo[(tp.topic, tp.partition)]  # passed over: nothing there
                for (t, p), o in list(todo.items()):
                    low, high = self._consumer.get_watermark_offsets(TopicPartition(t, p),
                                                                      cached=True)
                    if 0 <= high <= o or 0 <= o < low:
                        # Not written yet, or gone, as the last fetch said: asked anew
                        # before it counts (a record committed since is there).
                        low, high = self._consumer.get_watermark_offsets(
                            TopicPartition(t, p), timeout=max(deadline - time.monotonic(),
                                                              1.0), cached=False)
                    if 0 <= high <= o or 0 <= o < low:  # not written yet, or gone
                        del todo[(t, p)]
                if todo and time.monotonic() > deadline:
                    raise TimeoutError(f"reading {sorted(todo)} timed out")
        finally:
            self._consumer.unassign()
        return found

    def offset_for_time_sync(self, topic: str, partition: int, ms: int,
                             timeout: float = 10.0) -> int:
        """The first offset at or after time ``ms`` (the end of the partition if none)."""
        found = self._consumer.offsets_for_times([TopicPartition(topic, partition, ms)],
                                                 timeout=timeout)[0]
        if found.offset >= 0:
            return int(found.offset)
        return self.watermarks_sync(topic, partition)[1]

    # The same, awaited (as ``AsyncConsumer``'s).

    async def assign_from_start(self, topics: list[str]) -> dict[TP, int]:
        return await self.call(self.assign_from_start_sync, topics)

    async def add_partitions(self, starts: dict[TP, int]) -> None:
        await self.call(self.add_partitions_sync, starts)

    async def drop_partitions(self, partitions: list[TP]) -> None:
        await self.call(self.drop_partitions_sync, partitions)

    async def follow_from_end(self, topic: str) -> None:
        await self.call(self.follow_from_end_sync, topic)

    async def offset_for_time(self, topic: str, partition: int, ms: int,
                              request_s: float = 10.0) -> int:
        return await self.call(self.offset_for_time_sync, topic, partition, ms, request_s)

    async def read_range(self, topic: str, partition: int, start: int, end: int,
                         request_s: float = 30.0) -> list[Record]:
        return await self._stoppable(self.read_range_sync, topic, partition, start, end,
                                     request_s)

    async def read_at(self, wanted: Sequence[tuple[str, int, int]],
                      request_s: float = 30.0) -> dict[tuple[str, int, int], Record | None]:
        return await self._stoppable(self.read_at_sync, wanted, request_s)

    async def _stoppable(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args, stop=...)`` on the consumer's thread; if the caller stops waiting
        (cancelled: a timeout, a request gone), ``stop`` is set, and the read ends at its
        next poll instead of holding the thread to its own deadline (one not begun yet
        never runs)."""
        stop = threading.Event()
        try:
            return await self.call(fn, *args, stop=stop)
        except asyncio.CancelledError:
            stop.set()
            raise


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise GaveUp("the caller no longer waits for this read")
