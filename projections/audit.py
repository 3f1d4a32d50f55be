"""The full event history of one session, read straight from the log."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pipeline.codec import DecodeError, Position, conversation_key, decode
from pipeline.kafka import AsyncConsumer
from pipeline.partitioning import partition_for
from pipeline.topics import CONVERSATION_TOPICS, PROMPTS
from schemas import Event, TokenDelta


@dataclass(frozen=True)
class Entry:
    position: Position
    event: Event | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"topic": self.position.topic,
                               "partition": self.position.partition,
                               "offset": self.position.offset}
        if self.event is not None:
            out["event"] = self.event.model_dump(mode="json")
        else:
            out["error"] = self.error
        return out


def read_history(consumer: AsyncConsumer, conversation_id: uuid.UUID) -> list[Entry]:
    """Every record keyed by the conversation, from every topic it lives in (runs on the
    consumer thread). A conversation lives in one partition of each topic, so only those
    are read."""
    key = conversation_key(conversation_id)
    partitions = len(consumer.partitions_sync(PROMPTS))
    p = partition_for(key, partitions)
    ends = consumer.assign_partitions_sync([(t, p) for t in CONVERSATION_TOPICS])
    entries: list[Entry] = []
    remaining = dict(ends)
    while remaining:
        batch = consumer.poll_batch_sync(5000, 0.2)
        # Transaction markers are never delivered: the position says when a topic is done.
        for tp, position in consumer.positions_sync(list(remaining)).items():
            if position >= remaining[tp]:
                del remaining[tp]
        for record in batch:
            if record.key != key:
                continue
            try:
                entries.append(Entry(record.position, decode(record.value)))
            except DecodeError as exc:
                entries.append(Entry(record.position, None, str(exc)))
    entries.sort(key=lambda e: (e.event.occurred_at.timestamp() if e.event else 0.0,
                                e.position.topic != PROMPTS, e.position.offset))
    return entries


def format_text(entries: list[Entry], deltas: bool = False) -> str:
    """One line per event; token deltas summarised per generation unless ``deltas``."""
    lines = []
    pending: list[Entry] = []

    def flush() -> None:
        if pending:
            first, last = pending[0], pending[-1]
            assert isinstance(first.event, TokenDelta) and isinstance(last.event, TokenDelta)
            chars = sum(len(e.event.text) for e in pending if isinstance(e.event, TokenDelta))
            lines.append(f"{'':32}  {str(first.position) + '..' + str(last.position.offset):34}"
                         f"  TokenDelta x{len(pending)} (seq {first.event.seq}..{last.event.seq},"
                         f" {chars} chars)")
            pending.clear()

    for entry in entries:
        event = entry.event
        if isinstance(event, TokenDelta) and not deltas:
            pending.append(entry)
            continue
        flush()
        if event is None:
            lines.append(f"{'?':32}  {entry.position!s:34}  UNDECODABLE: {entry.error}")
            continue
        lines.append(f"{event.occurred_at.isoformat():32}  {entry.position!s:34}  "
                     f"{event.type} {_summary(event)}")
    flush()
    return "\n".join(lines)


def _summary(event: Event) -> str:
    data = event.model_dump(mode="json", exclude={"type", "v", "event_id", "conversation_id",
                                                   "occurred_at", "tenant"})
    if "messages" in data:
        data["messages"] = f"{len(data['messages'])} messages"
    if "text" in data and len(data["text"]) > 60:
        data["text"] = data["text"][:57] + "..."
    return json.dumps(data, ensure_ascii=False)


def audit(bootstrap: str, conversation_id: uuid.UUID) -> list[Entry]:
    import asyncio

    async def run() -> list[Entry]:
        consumer = AsyncConsumer(bootstrap, f"audit-{uuid.uuid4().hex[:12]}")
        try:
            return await consumer.call(read_history, consumer, conversation_id)
        finally:
            await consumer.close()

    return asyncio.run(run())
