"""The projector: reads both chat topics in group ``projector`` and keeps Postgres in step.

Exactly-once effect: each batch of events is applied in one transaction that also
records, per partition, the next offset to read. On assignment the projector seeks
to those stored positions, so a crash at any point neither loses nor repeats rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import DecodeError, decode
from pipeline.deadletter import dead_letter
from pipeline.kafka import BEGINNING, AsyncConsumer, EventProducer, KafkaException, Record
from pipeline.settings import ProjectorSettings
from pipeline.topics import GENERATIONS, PROMPTS
from projections.projection import project
from schemas import Event

log = logging.getLogger(__name__)
TP = tuple[str, int]
# Errors that belong to one event (a value Postgres refuses), not to the database.
EVENT_ERRORS = (psycopg.DataError, psycopg.IntegrityError)


class ProjectorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("projector_events", "Events applied to Postgres",
                              ["type"], registry=registry)
        self.dead_letters = Counter("projector_dead_letters",
                                    "Records sent to the dead-letter topic", registry=registry)
        self.batch_seconds = Histogram("projector_batch_seconds",
                                       "Time to apply one batch in one transaction",
                                       registry=registry)
        self.lag_events = Gauge("projector_lag_events",
                                "Records in the assigned partitions not yet applied",
                                registry=registry)
        self.lag_seconds = Gauge("projector_lag_seconds",
                                 "Age of the newest applied record while behind (0 if caught up)",
                                 registry=registry)


@dataclass
class Batch:
    """What applying a batch did."""

    positions: dict[TP, int] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    parked: list[tuple[Record, str]] = field(default_factory=list)


def load_positions(conn: psycopg.Connection) -> dict[TP, int]:
    rows = conn.execute("SELECT topic, partition, next_offset FROM projector_positions")
    return {(t, p): o for t, p, o in rows}


Park = Callable[[list[tuple[Record, str]]], Awaitable[None]]


async def apply_batch(
    conn: psycopg.AsyncConnection,
    records: list[Record],
    park: Park | None = None,
    keep: Callable[[Event], bool] = lambda _e: True,
) -> Batch:
    """Apply ``records`` and their positions in one transaction.

    Records that do not decode, and events whose rows Postgres refuses, are skipped
    and handed to ``park`` with the reason before the transaction commits, so they
    are dead-lettered before the positions that skip them are stored. Events for
    which ``keep`` is false are skipped silently (their positions advance).
    """
    batch = Batch()
    decoded: list[tuple[Record, Event]] = []
    for record in records:
        pos = record.position
        batch.positions[(pos.topic, pos.partition)] = pos.offset + 1
        try:
            event = decode(record.value)
        except DecodeError as exc:
            batch.parked.append((record, str(exc)))
            continue
        if keep(event):
            decoded.append((record, event))

    async def finish() -> None:
        await _store_positions(conn, batch.positions)
        if park is not None and batch.parked:
            await park(batch.parked)

    try:
        async with conn.transaction(), conn.pipeline():
            for _, event in decoded:
                await _write(conn, event, batch)
            await finish()
    except EVENT_ERRORS:
        # One bad event must not stop the projection: redo the batch one event at a
        # time, each in a savepoint, and park the events Postgres refuses.
        batch.applied.clear()
        async with conn.transaction():
            for record, event in decoded:
                try:
                    async with conn.transaction():
                        await _write(conn, event, batch)
                except EVENT_ERRORS as exc:
                    batch.parked.append((record, f"rejected by the store: {exc}"))
            await finish()
    return batch


async def _write(conn: psycopg.AsyncConnection, event: Event, batch: Batch) -> None:
    for write in project(event):
        await conn.execute(write.sql, write.params)
    batch.applied[event.type] = batch.applied.get(event.type, 0) + 1


async def _store_positions(conn: psycopg.AsyncConnection, positions: dict[TP, int]) -> None:
    async with conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO projector_positions (topic, partition, next_offset)"
            " VALUES (%s, %s, %s) ON CONFLICT (topic, partition)"
            " DO UPDATE SET next_offset = EXCLUDED.next_offset",
            [(t, p, o) for (t, p), o in positions.items()],
        )


class Projector:
    def __init__(
        self,
        settings: ProjectorSettings,
        bootstrap: str,
        database_url: str,
        registry: CollectorRegistry,
        topics: tuple[str, str] = (PROMPTS, GENERATIONS),
        group: str | None = None,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.metrics = ProjectorMetrics(registry)
        self.topics = topics
        self.group = group or settings.group

    def _on_assign(self, partitions: list[TP]) -> dict[TP, int]:
        """Start every assigned partition at the position stored with the rows."""
        with psycopg.connect(self.database_url) as conn:
            stored = load_positions(conn)
        start = {tp: stored.get(tp, BEGINNING) for tp in partitions}
        log.info("assigned %s", {f"{t}/{p}": o for (t, p), o in start.items()})
        return start

    async def run(self, stop: asyncio.Event) -> None:
        producer = EventProducer(self.bootstrap)
        consumer = AsyncConsumer(self.bootstrap, self.group,
                                 **{"session.timeout.ms": self.settings.session_timeout_ms})
        consumer.subscribe(list(self.topics), on_assign=self._on_assign)
        try:
            async with await psycopg.AsyncConnection.connect(self.database_url) as conn:
                while not stop.is_set():
                    records = await consumer.poll_batch(
                        self.settings.batch_max_events, self.settings.batch_max_ms / 1000
                    )
                    if records:
                        positions = await self._apply(conn, producer, records)
                        await self._commit_for_lag_tools(consumer, positions)
                        newest = records[-1].timestamp_ms / 1000
                    else:
                        newest = time.time()
                    behind = sum((await consumer.call(consumer.lag_sync)).values())
                    self.metrics.lag_events.set(behind)
                    self.metrics.lag_seconds.set(max(time.time() - newest, 0) if behind else 0)
        finally:
            await consumer.close()
            producer.close()

    async def _commit_for_lag_tools(
        self, consumer: AsyncConsumer, positions: dict[TP, int]
    ) -> None:
        """Mirror the positions into Kafka for lag tools; Postgres holds the real ones."""
        try:
            await consumer.commit(positions)
        except KafkaException as exc:
            log.warning("could not mirror positions to Kafka (harmless): %s", exc)

    async def _apply(
        self, conn: psycopg.AsyncConnection, producer: EventProducer, records: list[Record]
    ) -> dict[TP, int]:
        started = time.perf_counter()

        async def park(parked: list[tuple[Record, str]]) -> None:
            await asyncio.gather(*(dead_letter(producer, r, why, self.group)
                                   for r, why in parked))

        batch = await apply_batch(conn, records, park)
        self.metrics.dead_letters.inc(len(batch.parked))
        for kind, n in batch.applied.items():
            self.metrics.events.labels(kind).inc(n)
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return batch.positions
