"""Dead letters: a record that cannot be decoded is parked with its reason, never dropped."""

from __future__ import annotations

import asyncio
import logging

from pipeline.codec import Position
from pipeline.kafka import EventProducer, Record
from pipeline.topics import DEADLETTER

log = logging.getLogger(__name__)


def dead_letter_headers(record: Record, reason: str, consumer: str) -> list[tuple[str, bytes]]:
    """Where a dead letter came from and why."""
    return [
        ("source.topic", record.position.topic.encode()),
        ("source.partition", str(record.position.partition).encode()),
        ("source.offset", str(record.position.offset).encode()),
        ("reason", reason.encode(errors="replace")),
        ("consumer", consumer.encode()),
    ]


def dead_letter(
    producer: EventProducer, record: Record, reason: str, consumer: str
) -> asyncio.Future[Position]:
    """Send the original bytes to the dead-letter topic, with where they came from and why.
    A value too large for the topic (read from a cluster that takes larger records than
    this producer sends) is cut to fit, and a ``truncated`` header gives its whole size:
    the whole record stays at its position in its own topic."""
    log.warning("dead-lettering %s: %s", record.position, reason)
    headers = dead_letter_headers(record, reason, consumer)
    value = record.value
    room = producer.max_record_bytes - len(record.key or b"") - sum(
        len(k) + len(v) for k, v in headers) - 64
    if value is not None and len(value) > room:
        headers.append(("truncated", str(len(value)).encode()))
        value = value[:max(room, 0)]
    return producer.send_raw(DEADLETTER, record.key, value, headers)
