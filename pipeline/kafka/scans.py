"""Reading a group's committed offsets and ranges of a topic, outside any group: for
status pages, audits, benches and tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator

from confluent_kafka import (
    Consumer,
    KafkaException,
    TopicPartition,
)

from pipeline.codec import TP
from pipeline.kafka.client import (
    LATEST,
    NO_NAGLE,
    QUEUE_REFILL,
    Record,
    client_config,
    client_logging,
    poll_records,
)


def group_committed(bootstrap: str, group: str, partitions: list[TP],
                    timeout: float = 10.0) -> dict[TP, int]:
    """Another group's committed offsets (without joining it); partitions it never
    committed are left out."""
    consumer = Consumer({**client_config(bootstrap, "group-status"), "group.id": group,
                         "enable.auto.commit": False, **client_logging("group-status")})
    try:
        found = consumer.committed([TopicPartition(t, p) for t, p in partitions],
                                   timeout=timeout)
        return {(tp.topic, tp.partition): int(tp.offset) for tp in found if tp.offset >= 0}
    finally:
        consumer.close()


class GroupStatus:
    """A consumer group seen from outside, without joining it: how far it is behind the
    end of a topic (its committed offsets)."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self._consumer = Consumer({**client_config(bootstrap, "group-status"), "group.id": group,
                                   **client_logging("group-status"),
                                   "enable.auto.commit": False})
        self._known: dict[str, tuple[float, list[int]]] = {}

    def per_partition(self, topic: str, timeout: float = 5.0,
                      uncommitted_at_end: bool = False) -> dict[int, tuple[int, int]]:
        """Per partition: (committed offset, end offset); a partition the group never
        committed counts from its start (or, ``uncommitted_at_end``, as caught up).
        Two requests whatever the number of partitions: the committed offsets, and the
        ends in one ListOffsets (a gateway measures this four times a second)."""
        return {p: (start, end) for p, (start, end, _) in self.committed_and_ends(
            topic, timeout, uncommitted_at_end).items()}

    def committed_and_ends(self, topic: str, timeout: float = 5.0,
                           uncommitted_at_end: bool = False
                           ) -> dict[int, tuple[int, int, str]]:
        """``per_partition``, with what each commit said besides its offset (its
        metadata; empty if none)."""
        parts = [TopicPartition(topic, p) for p in self._partitions(topic, timeout)]
        committed = self._consumer.committed(parts, timeout=timeout)
        ends = {tp.partition: int(tp.offset) for tp in self._consumer.offsets_for_times(
            [TopicPartition(topic, p.partition, LATEST) for p in parts], timeout=timeout)}
        out = {}
        for tp in committed:
            high = ends[tp.partition]
            if tp.offset >= 0:
                start = int(tp.offset)
            elif uncommitted_at_end:
                start = high
            else:
                start = int(self._consumer.get_watermark_offsets(tp, timeout=timeout)[0])
            out[tp.partition] = (start, high, tp.metadata or "")
        return out

    def _partitions(self, topic: str, timeout: float) -> list[int]:
        """The topic's partitions, looked up again at most once a minute."""
        known = self._known.get(topic)
        if known is None or time.monotonic() - known[0] > 60:
            meta = self._consumer.list_topics(topic, timeout=timeout).topics[topic]
            if meta.error is not None:
                raise KafkaException(meta.error)
            known = self._known[topic] = (time.monotonic(), sorted(meta.partitions))
        return known[1]

    def close(self) -> None:
        self._consumer.close()


def high_watermarks(bootstrap: str, topic: str, partitions: list[int],
                    timeout: float = 10.0) -> dict[int, int]:
    """The true end of each partition, open transactions' records included (a
    read_committed client's watermark is the last stable offset instead)."""
    consumer = Consumer({**client_config(bootstrap, "scan"), "group.id": "watermarks",
                         **client_logging("scan"),
                         "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
    try:
        return {p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout,
                                                      cached=False)[1])
                for p in partitions}
    finally:
        consumer.close()


def read_spans(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
               timeout: float = 60.0) -> list[Record]:
    """The committed records of ``topic`` in ``[start, end)`` of each partition, in log
    order per partition. Records of transactions still open below ``end`` are waited
    for until their transaction commits (they are included) or aborts (they are not)."""
    return list(iter_spans(bootstrap, topic, spans, timeout))


def iter_spans(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
               timeout: float = 60.0) -> Generator[Record, None, None]:
    """``read_spans``, one record at a time as they are read: a long span is never held
    whole. ``timeout`` bounds a wait with no progress (a transaction left open below a
    span's end), not the whole read, which may be long."""
    todo = {p: span for p, span in spans.items() if span[0] < span[1]}
    if not todo:
        return
    consumer = Consumer({**client_config(bootstrap, "scan"), "group.id": "scan",
                         **client_logging("scan"),
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         **NO_NAGLE, **QUEUE_REFILL})
    try:
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in todo.items()])
        positions = {p: start for p, (start, _) in todo.items()}
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} {sorted(todo)} made no progress "
                                   f"for {timeout:.0f} s")
            for record in poll_records(consumer, 5000, 0.2):
                span = todo.get(record.position.partition)
                if span is not None and record.position.offset < span[1]:
                    yield record
            # Aborted records and transaction markers are never delivered: the position
            # tells when a partition's span has been read.
            for tp in consumer.position([TopicPartition(topic, p) for p in list(todo)]):
                if tp.offset > positions[tp.partition]:
                    positions[tp.partition] = tp.offset
                    deadline = time.monotonic() + timeout
                if tp.offset >= todo[tp.partition][1]:
                    del todo[tp.partition]
    finally:
        consumer.close()


def first_records(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
                  timeout: float = 60.0, wanted: Callable[[Record], bool] | None = None
                  ) -> dict[int, Record]:
    """The first committed record in ``[start, end)`` of each partition that has one (a
    consumer's committed offset may be a transaction marker's, or an aborted record's);
    ``wanted`` given, the first it takes (a partition's whole span is read if none)."""
    found: dict[int, Record] = {}
    partitions = sum(start < end for start, end in spans.values())
    records = iter_spans(bootstrap, topic, spans, timeout)
    try:
        for record in records:
            if wanted is not None and (record.position.partition in found
                                       or not wanted(record)):
                continue
            found.setdefault(record.position.partition, record)
            if len(found) == partitions:
                break
    finally:
        records.close()
    return found


def scan_partitions(
    bootstrap: str, topic: str, partitions: list[int], since_ms: int | dict[int, int],
    timeout: float = 60.0, ends: dict[int, int] | None = None,
) -> Iterator[Record]:
    """Every committed record of ``topic``'s ``partitions`` from time ``since_ms`` (one for
    all, or per partition) to their true end now (or to ``ends``): a record written before
    the call is in the answer unless its transaction aborts. The span is fixed by the
    call; its records come one at a time (``iter_spans``)."""
    if not partitions:
        return iter(())
    if ends is None:
        ends = high_watermarks(bootstrap, topic, partitions)
    since = since_ms if isinstance(since_ms, dict) else dict.fromkeys(partitions, since_ms)
    consumer = Consumer({**client_config(bootstrap, "scan"), "group.id": "scan",
                         **client_logging("scan"),
                         "enable.auto.commit": False})
    try:
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, since[p]) for p in partitions], timeout=timeout)
    finally:
        consumer.close()
    spans = {tp.partition: (int(tp.offset), ends[tp.partition]) for tp in starts
             if tp.offset >= 0}  # -1: nothing that recent
    return iter_spans(bootstrap, topic, spans, timeout)


# What a cluster answers a client it will not let in, or that cannot trust it.
