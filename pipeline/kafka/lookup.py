"""Random access to a topic: the records at given offsets, read with seeks. A keyring
finds each data key where the content that names it says it lies (``pipeline.keystore``):
one fetch per partition asked, whatever the topic holds besides.

Synchronous, outside any group, on one consumer that callers share one at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, TopicPartition

from pipeline.kafka.client import NO_NAGLE, Record, client_config, client_logging, poll_records

# A wanted offset this far past the last record read is sought; a nearer one is read up to
# (a fetch brings about this many small records anyway).
SEEK_GAP = 256
# The most records read on the way to the wanted ones that a lookup hands back.
NEARBY_MAX = 4096


@dataclass
class Lookup:
    """What a lookup found, per (partition, offset) asked."""

    found: dict[tuple[int, int], Record] = field(default_factory=dict)
    # The offset holds no record any more: compacted away, below the partition's start,
    # or a transaction marker.
    missing: set[tuple[int, int]] = field(default_factory=set)
    # At or past the partition's end, as its leader answered.
    beyond: set[tuple[int, int]] = field(default_factory=set)
    # The other records the same fetches brought, on the way to the wanted ones and
    # past them (no fetch more is made for them), for a caller that reads ahead.
    nearby: list[Record] = field(default_factory=list)


class PositionReader:
    """Reads records at exact offsets of one topic. Fetches are kept small, so a lookup
    costs one small fetch per partition asked rather than a prefetch of megabytes."""

    def __init__(self, bootstrap: str, topic: str, name: str,
                 fetch_bytes: int = 64 * 1024) -> None:
        self.topic = topic
        self._consumer = Consumer({
            **client_config(bootstrap, "lookup"), "group.id": name, "enable.auto.commit": False,
            "isolation.level": "read_committed", "fetch.wait.max.ms": 1,
            "max.partition.fetch.bytes": fetch_bytes, "fetch.max.bytes": 2**20,
            "queued.max.messages.kbytes": max(4 * fetch_bytes // 1024, 64),
            # It fetches only into an empty queue (librdkafka otherwise fetches again the
            # moment a fetch comes back: a look-up of one record cost two fetches, 1.25
            # now), and looks again 1 ms after its queue empties, not the 10 ms of
            # ``QUEUE_REFILL``: it is assigned only while it reads, so never waits idle.
            "queued.min.messages": 1, "fetch.queue.backoff.ms": 1,
            **NO_NAGLE, **client_logging(name)})

    def partitions(self, timeout: float = 10.0) -> list[int]:
        meta = self._consumer.list_topics(self.topic, timeout=timeout).topics[self.topic]
        if meta.error is not None:
            raise KafkaException(meta.error)
        return sorted(meta.partitions)

    def bounds(self, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """The partition's first offset and its end, asked of its leader now."""
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=timeout, cached=False)
        return int(low), int(high)

    def read(self, wanted: Iterable[tuple[int, int]], timeout: float = 10.0) -> Lookup:
        """The records at ``wanted`` (partition, offset) positions (``TimeoutError`` if
        the partitions' leaders do not answer within ``timeout``)."""
        todo: dict[int, list[int]] = {}
        for partition, offset in sorted(set(wanted)):
            todo.setdefault(partition, []).append(offset)
        out = Lookup()
        if not todo:
            return out
        consumer = self._consumer
        consumer.assign([TopicPartition(self.topic, p, offsets[0])
                         for p, offsets in todo.items()])
        sought = {p: offsets[0] for p, offsets in todo.items()}
        deadline = time.monotonic() + timeout
        try:
            while todo:
                records = poll_records(consumer, 500, 0.05)
                for record in records:
                    self._take(record, todo, sought, out)
                if records:
                    continue
                # Nothing came: offsets past what the consumer passed (markers), past the
                # end, or below the start of a partition.
                for tp in consumer.position([TopicPartition(self.topic, p) for p in todo]):
                    offsets = todo.get(tp.partition)
                    while offsets and 0 <= offsets[0] < tp.offset:
                        out.missing.add((tp.partition, offsets.pop(0)))
                    if offsets is not None and not offsets:
                        del todo[tp.partition]
                for partition in list(todo):
                    try:
                        low, high = self.bounds(partition,
                                                max(deadline - time.monotonic(), 0.5))
                    except KafkaException:  # a leader moving: asked again, in time
                        if time.monotonic() > deadline:
                            raise
                        continue
                    offsets = todo[partition]
                    while offsets and offsets[0] < low:
                        out.missing.add((partition, offsets.pop(0)))
                    while offsets and offsets[-1] >= high:
                        out.beyond.add((partition, offsets.pop()))
                    if not offsets:
                        del todo[partition]
                if todo and time.monotonic() > deadline:
                    raise TimeoutError(f"reading {self.topic} at {_summary(todo)} made no "
                                       f"progress in {timeout:g} s")
        finally:
            consumer.unassign()
        return out

    def _take(self, record: Record, todo: dict[int, list[int]], sought: dict[int, int],
              out: Lookup) -> None:
        partition, offset = record.position.partition, record.position.offset
        if offset < sought.get(partition, offset + 1):  # fetched before the last seek
            return
        if len(out.nearby) < NEARBY_MAX:
            out.nearby.append(record)
        offsets = todo.get(partition)
        if not offsets:  # past what was wanted of it: brought by the same fetch
            return
        while offsets and offsets[0] < offset:  # passed over: compacted away
            out.missing.add((partition, offsets.pop(0)))
        if offsets and offsets[0] == offset:
            out.found[(partition, offset)] = record
            offsets.pop(0)
        if not offsets:
            del todo[partition]
        elif offsets[0] > offset + SEEK_GAP:
            sought[partition] = offsets[0]
            self._consumer.seek(TopicPartition(self.topic, partition, offsets[0]))

    def close(self) -> None:
        self._consumer.close()


def _summary(todo: dict[int, list[int]]) -> str:
    return ", ".join(f"{p}@{offsets[0]}" for p, offsets in sorted(todo.items()))


__all__ = ["Lookup", "PositionReader"]
