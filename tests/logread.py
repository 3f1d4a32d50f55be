"""Read a topic from the beginning up to its current end, as an auditor would: committed
records only (``isolation.level=read_committed``), unless asked for everything."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, TopicPartition

from pipeline.codec import DecodeError, Position, decode
from schemas import Event

RawRecord = tuple[Position, bytes | None, dict[str, bytes]]


def read_records(bootstrap: str, topic: str, committed: bool = True,
                 timeout: float = 30.0) -> list[RawRecord]:
    isolation = "read_committed" if committed else "read_uncommitted"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": isolation})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = end_offsets(bootstrap, topic)
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out = []
        remaining = {p for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + timeout
        while remaining:
            assert time.monotonic() < deadline, f"timed out reading {topic}"
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                headers = {k: v for k, v in (msg.headers() or [])}
                out.append((Position(topic, msg.partition(), msg.offset()), msg.value(),
                            headers))
            # Transaction markers and aborted records are never delivered: the position
            # tells when a partition has been read to its end.
            for tp in consumer.position([TopicPartition(topic, p) for p in remaining]):
                if tp.offset >= ends[tp.partition]:
                    remaining.discard(tp.partition)
        return out
    finally:
        consumer.close()


def read_events(bootstrap: str, topic: str,
                committed: bool = True) -> list[tuple[Position, Event]]:
    events = []
    for position, value, _ in read_records(bootstrap, topic, committed):
        try:
            events.append((position, decode(value)))
        except DecodeError:
            continue
    return events


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """Each partition's true end (its high watermark, open transactions included)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "isolation.level": "read_uncommitted"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in parts}
    finally:
        consumer.close()
