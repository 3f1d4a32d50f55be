"""Read a topic from the beginning up to its current end, as an auditor would."""

from __future__ import annotations

import uuid

from confluent_kafka import Consumer, TopicPartition

from pipeline.codec import DecodeError, Position, decode
from schemas import Event

RawRecord = tuple[Position, bytes | None, dict[str, bytes]]


def read_records(bootstrap: str, topic: str) -> list[RawRecord]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in parts}
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        out = []
        remaining = {p for p, end in ends.items() if end > 0}
        while remaining:
            msg = consumer.poll(10)
            assert msg is not None, f"timed out reading {topic}"
            if msg.error():
                continue
            p = msg.partition()
            headers = {k: v for k, v in (msg.headers() or [])}
            out.append((Position(topic, p, msg.offset()), msg.value(), headers))
            if msg.offset() + 1 >= ends[p]:
                remaining.discard(p)
        return out
    finally:
        consumer.close()


def read_events(bootstrap: str, topic: str) -> list[tuple[Position, Event]]:
    events = []
    for position, value, _ in read_records(bootstrap, topic):
        try:
            events.append((position, decode(value)))
        except DecodeError:
            continue
    return events


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in parts}
    finally:
        consumer.close()
