"""Conversations read consistently with the log, from any gateway process.

``view(conversation)`` reads the stored rows and the projector's positions in one
snapshot, then folds in the conversation's records that lie between those
positions and the end of the log (``gateway.view``). Whatever was acknowledged
before the call is in the answer, even while the projector lags: a session's next
turn sees the previous reply at once. Listing sessions spans every partition, so
it waits for the projector instead (``catch_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from prometheus_client import Counter
from psycopg_pool import AsyncConnectionPool

from gateway.dependencies import from_log, from_store
from gateway.problems import StoreLagging
from gateway.settings import GatewaySettings
from gateway.view import ConversationView, Message, TurnState
from pipeline.codec import TP, Codec, DecodeError, conversation_key
from pipeline.kafka import LogReader, Record
from pipeline.partitioning import partition_for
from pipeline.retry import Backoff
from pipeline.topics import CONTROL, CONVERSATION_TOPICS, LIVE, PROMPTS
from schemas import Event, Usage
from schemas.live import LiveBatch

TOPICS = CONVERSATION_TOPICS
# The most data keys of one conversation a view reads (a conversation has one, or a few:
# one per gateway that took its first turn at once).
MAX_KEYS = 64


class ConversationStore:
    def __init__(
        self, pool: AsyncConnectionPool, meta: LogReader, reader: LogReader,
        partitions: int, codec: Codec, settings: GatewaySettings,
        reads: Counter | None = None,
    ) -> None:
        self.pool = pool
        self.meta = meta  # quick metadata calls (watermarks)
        self.reader = reader  # range reads, which may take longer
        self.partitions = partitions
        self.codec = codec  # opens the content it reads
        self.wait_s = settings.projection_wait_s
        self.max_unprojected = settings.max_unprojected
        # Each call to Kafka or PostgreSQL waits at most this long (range reads twice).
        self.timeout_s = settings.dependency_timeout_s
        self.reads = reads  # records read, by topic (gateway_log_read_records)

    def _read(self, topic: str, records: int) -> None:
        if self.reads is not None and records:
            self.reads.labels(topic).inc(records)

    def partition_of(self, conversation_id: uuid.UUID) -> int:
        return partition_for(conversation_key(conversation_id), self.partitions)

    async def ends_of(self, partitions: list[TP]) -> dict[TP, int]:
        """The ends of ``partitions`` (of any topics), in one request to each leader."""
        return await from_log(lambda: self.meta.ends(partitions, self.timeout_s),
                              self.timeout_s)

    async def start_of(self, topic: str, partition: int) -> int:
        """The partition's first offset (what retention left)."""
        ends = await from_log(lambda: self.meta.watermarks(topic, partition,
                                             self.timeout_s), self.timeout_s)
        return ends[0]

    async def offset_at(self, topic: str, partition: int, ms: int) -> int:
        return await from_log(lambda: self.reader.offset_for_time(topic,
                                               partition, ms, self.timeout_s), self.timeout_s)

    async def events(self, topic: str, conversation_id: uuid.UUID, start: int,
                     end: int, keyed: bool = True) -> list[tuple[Record, Event | None]]:
        """The conversation's events in ``[start, end)`` of its partition of ``topic``
        (records that do not decode are the projector's to dead-letter); with ``keyed``
        false, every record's, the others' as None (what positions the log holds)."""
        key = conversation_key(conversation_id)

        async def read() -> list[tuple[Record, Event | None]]:
            records = await self.reader.read_range(
                topic, self.partition_of(conversation_id), start, end, 2 * self.timeout_s)
            self._read(topic, len(records))
            out: list[tuple[Record, Event | None]] = []
            for record in records:
                if record.key == key:
                    with contextlib.suppress(DecodeError):
                        out.append((record, await self.codec.decode_async(record.value)))
                        continue
                if not keyed:
                    out.append((record, None))
            return out

        return await from_log(read, 2 * self.timeout_s)

    async def live(self, partition: int, start: int, end: int) -> list[tuple[Record, LiveBatch]]:
        """The live stream's batches in ``[start, end)`` of ``partition`` (records that do
        not decode are passed over: the fan-out says so)."""
        async def read() -> list[tuple[Record, LiveBatch]]:
            records = await self.reader.read_range(LIVE, partition, start, end,
                                                   2 * self.timeout_s)
            self._read(LIVE, len(records))
            out = []
            for record in records:
                with contextlib.suppress(DecodeError):
                    out.append((record, await self.codec.decode_live_async(record.value)))
            return out

        return await from_log(read, 2 * self.timeout_s)

    async def event_at(self, topic: str, partition: int, offset: int) -> Event | None:
        """The event at ``offset`` (None: no event is there, or no longer)."""
        position = (topic, partition, offset)

        async def read() -> Event | None:
            record = (await self.reader.read_at([position], 2 * self.timeout_s))[position]
            self._read(topic, 1)
            try:
                return await self.codec.decode_async(record.value) if record is not None else None
            except DecodeError:
                return None

        return await from_log(read, 2 * self.timeout_s)

    async def view(self, conversation_id: uuid.UUID) -> ConversationView:
        p = self.partition_of(conversation_id)
        ends = {t: end for (t, _), end in (await self.ends_of([(t, p) for t in TOPICS])).items()}
        view, positions = await self._stored(conversation_id, p)
        view.prompts_end = ends[PROMPTS]
        for topic in TOPICS:
            start = positions.get(topic, 0)
            if ends[topic] - start > self.max_unprojected:
                raise StoreLagging()
            await self.fold(view, topic, start, ends[topic])
        return view

    async def fold(self, view: ConversationView, topic: str, start: int, end: int) -> None:
        """Fold the conversation's events in ``[start, end)`` of ``topic`` into ``view``."""
        for record, event in await self.events(topic, view.id, start, end):
            if event is not None:
                view.apply(event, record.position.offset)

    async def _stored(self, conversation_id: uuid.UUID,
                      partition: int) -> tuple[ConversationView, dict[str, int]]:
        view = ConversationView(conversation_id)
        async with from_store(self.pool, self.timeout_s) as conn, conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            positions: dict[str, int] = dict(await (await conn.execute(
                "SELECT topic, next_offset FROM projector_positions"
                " WHERE partition = %s AND topic = ANY(%s)", (partition, list(TOPICS)),
            )).fetchall())
            row = await (await conn.execute(
                "SELECT tenant, title, created_at, updated_at, deleted, memory_user"
                " FROM conversations WHERE id = %s", (conversation_id,))).fetchone()
            if row is not None:
                (view.tenant, view.title, view.created_at, view.updated_at,
                 view.deleted, view.memory_user) = row
            for seq, role, content, request_id, at in await (await conn.execute(
                "SELECT seq, role, content, request_id, created_at FROM messages"
                " WHERE conversation_id = %s", (conversation_id,))).fetchall():
                view.messages[seq] = Message(role, content, request_id, at)
            for (request_id, status, model, at, offset, end, ended, began, reason,
                 prompt_tokens, completion_tokens, code, message) in await (
                    await conn.execute(
                        "SELECT request_id, status, model, submitted_at, prompt_offset,"
                        " end_offset, CASE WHEN end_offset IS NOT NULL THEN finished_at END,"
                        " started_at, finish_reason, prompt_tokens, completion_tokens,"
                        " error_code, error_message"
                        " FROM generations WHERE conversation_id = %s",
                        (conversation_id,))).fetchall():
                view.stored_turn(TurnState(
                    request_id, status, model, at, offset, end, ended, began, reason,
                    Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
                    if None not in (reason, prompt_tokens, completion_tokens) else None,
                    (code, message or "") if code is not None else None))
            view.key_refs = [ref for ref, in await (await conn.execute(
                "SELECT key_id FROM data_keys WHERE conversation_id = %s"
                " ORDER BY created_at, key_id LIMIT %s",
                (conversation_id, MAX_KEYS))).fetchall()]
        return view, positions

    async def catch_up(self, topic: str) -> None:
        """Wait until the projection holds all of ``topic`` that the log held when called."""
        targets = await self.ends_of([(topic, p) for p in range(self.partitions)])
        deadline = time.monotonic() + self.wait_s
        backoff = Backoff(0.005, 0.1)
        while True:
            async with from_store(self.pool, self.timeout_s) as conn:
                rows = await (await conn.execute(
                    "SELECT topic, partition, next_offset FROM projector_positions"
                    " WHERE topic = %s", (topic,))).fetchall()
            done = {(t, p): o for t, p, o in rows}
            if all(done.get(tp, 0) >= end for tp, end in targets.items()):
                return
            if time.monotonic() > deadline:
                raise StoreLagging()
            await asyncio.sleep(backoff.next())

    async def list_sessions(self, tenant: str, limit: int,
                            after: uuid.UUID | None) -> tuple[list[dict[str, Any]], bool]:
        """The tenant's sessions, newest first, ``limit`` at a time after session ``after``."""
        for topic in (PROMPTS, CONTROL):  # prompts and SessionCreated make sessions
            await self.catch_up(topic)
        cursor = "" if after is None else (
            " AND (created_at, id) < (SELECT created_at, id FROM conversations"
            " WHERE id = %(after)s AND tenant = %(tenant)s)")
        async with from_store(self.pool, self.timeout_s) as conn:
            rows = await (await conn.execute(
                "SELECT id, title, created_at, updated_at FROM conversations"
                " WHERE tenant = %(tenant)s AND NOT deleted" + cursor +
                " ORDER BY created_at DESC, id DESC LIMIT %(limit)s",
                {"tenant": tenant, "after": after, "limit": limit + 1})).fetchall()
        sessions = [session_json(i, title, created, updated)
                    for i, title, created, updated in rows[:limit]]
        return sessions, len(rows) > limit


def session_json(session_id: object, title: str | None, created_at: Any,
                 updated_at: Any) -> dict[str, Any]:
    return {"id": str(session_id), "object": "session", "title": title,
            "created_at": int(created_at.timestamp()) if created_at else None,
            "updated_at": int(updated_at.timestamp()) if updated_at else None}
