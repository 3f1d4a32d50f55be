"""The projector: reads both chat topics in group ``projector`` and keeps Postgres in step.

Exactly-once effect: each batch of events is applied in one transaction that also
records, per partition, the next offset to read. On assignment the projector seeks
to those stored positions, so a crash at any point neither loses nor repeats rows.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psycopg
from prometheus_client import CollectorRegistry, Counter, Histogram

from pipeline.codec import DecodeError, decode
from pipeline.deadletter import dead_letter
from pipeline.kafka import BEGINNING, AsyncConsumer, EventProducer, Record
from pipeline.settings import ProjectorSettings
from pipeline.topics import GENERATIONS, PROMPTS
from projections.projection import project

log = logging.getLogger(__name__)
GROUP = "projector"


class ProjectorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("projector_events", "Events applied to Postgres",
                              ["type"], registry=registry)
        self.dead_letters = Counter("projector_dead_letters",
                                    "Records sent to the dead-letter topic", registry=registry)
        self.batch_seconds = Histogram("projector_batch_seconds",
                                       "Time to apply one batch in one transaction",
                                       registry=registry)


def load_positions(conn: psycopg.Connection) -> dict[tuple[str, int], int]:
    rows = conn.execute("SELECT topic, partition, next_offset FROM projector_positions")
    return {(t, p): o for t, p, o in rows}


class Projector:
    def __init__(
        self,
        settings: ProjectorSettings,
        bootstrap: str,
        database_url: str,
        registry: CollectorRegistry,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.metrics = ProjectorMetrics(registry)

    def _on_assign(self, partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Start every assigned partition at the position stored with the rows."""
        with psycopg.connect(self.database_url) as conn:
            stored = load_positions(conn)
        start = {tp: stored.get(tp, BEGINNING) for tp in partitions}
        log.info("assigned %s", {f"{t}/{p}": o for (t, p), o in start.items()})
        return start

    async def run(self, stop: asyncio.Event) -> None:
        producer = EventProducer(self.bootstrap)
        consumer = AsyncConsumer(self.bootstrap, GROUP)
        consumer.subscribe([PROMPTS, GENERATIONS], on_assign=self._on_assign)
        try:
            async with await psycopg.AsyncConnection.connect(self.database_url) as conn:
                while not stop.is_set():
                    records = await consumer.poll_batch(
                        self.settings.batch_max_events, self.settings.batch_max_ms / 1000
                    )
                    if records:
                        offsets = await self.apply(conn, producer, records)
                        await consumer.commit(offsets)  # for lag monitoring only
        finally:
            await consumer.close()
            producer.close()

    async def apply(
        self, conn: psycopg.AsyncConnection, producer: EventProducer, records: list[Record]
    ) -> dict[tuple[str, int], int]:
        """Apply a batch and its positions in one transaction; return the positions."""
        started = time.perf_counter()
        positions: dict[tuple[str, int], int] = {}
        parked = []
        async with conn.transaction(), conn.pipeline(), conn.cursor() as cur:
            for record in records:
                pos = record.position
                positions[(pos.topic, pos.partition)] = pos.offset + 1
                try:
                    event = decode(record.value)
                except DecodeError as exc:
                    parked.append(dead_letter(producer, record, str(exc), GROUP))
                    continue
                for write in project(event):
                    await cur.execute(write.sql, write.params)
                self.metrics.events.labels(event.type).inc()
            # The dead letters must be durable before the positions that skip them.
            await asyncio.gather(*parked)
            self.metrics.dead_letters.inc(len(parked))
            await cur.executemany(
                "INSERT INTO projector_positions (topic, partition, next_offset)"
                " VALUES (%s, %s, %s) ON CONFLICT (topic, partition)"
                " DO UPDATE SET next_offset = EXCLUDED.next_offset",
                [(t, p, o) for (t, p), o in positions.items()],
            )
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return positions
