"""Rebuild the conversation store from the log, into an empty database or schema.

The replay reads both topics from their start up to the end they have when it
begins, through the same projection and batch transactions as the live projector
(positions included, so a live projector can take the rebuilt store over), the content
opened with the codec it is given (a keyring's, as the projector's).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg import sql
from tqdm import tqdm

from pipeline.codec import Codec
from pipeline.kafka import LogReader
from pipeline.pgschema import create_schema
from pipeline.topics import STORE_TOPICS
from projections.migrate import in_schema, migrate
from projections.projector import apply_batch, store_positions
from schemas import Event


class ReplayError(RuntimeError):
    pass


@dataclass(frozen=True)
class ReplayStats:
    records: int
    applied: int
    skipped_after_until: int
    undecodable: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def prepare_target(database_url: str, schema: str | None) -> None:
    """Create the schema if asked, refuse a store that already has rows, migrate."""
    in_schema(database_url, schema)  # validates the name before it reaches SQL
    if schema:
        create_schema(database_url, schema)
    with psycopg.connect(database_url, autocommit=True) as conn:
        where = schema or "public"
        exists = conn.execute(
            "SELECT 1 FROM information_schema.tables WHERE table_schema = %s"
            " AND table_name = 'conversations'", (where,)).fetchone()
        if exists:
            count = conn.execute(sql.SQL("SELECT count(*) FROM {}.conversations").format(
                sql.Identifier(where))).fetchone()
            if count and count[0]:
                raise ReplayError(f"the target {where!r} already holds {count[0]} conversations;"
                                  " replay needs an empty database or schema: drop it (a"
                                  " replay cut short leaves one so) or name another")
    migrate(database_url, schema=schema)


async def replay(
    bootstrap: str,
    database_url: str,
    codec: Codec,
    *,
    schema: str | None = None,
    until: datetime | None = None,
    batch_size: int = 2000,
    progress: bool = True,
    topics: tuple[str, ...] = STORE_TOPICS,
) -> ReplayStats:
    prepare_target(database_url, schema)
    consumer = LogReader(bootstrap, f"replay-{uuid.uuid4().hex[:12]}", "replay")
    records_seen = applied = undecodable = 0

    def keep(event: Event) -> bool:
        return until is None or event.occurred_at <= until

    try:
        ends = await consumer.assign_from_start(list(topics))
        remaining = dict(ends)
        total = await consumer.call(_count_to_read, consumer, remaining)
        bar = tqdm(total=total, unit="ev", desc="replay", disable=not progress)
        started = time.perf_counter()  # the rate covers reading and applying only
        async with await psycopg.AsyncConnection.connect(in_schema(database_url, schema),
                                                         autocommit=True) as conn:
            while remaining:
                records = await consumer.poll_batch(batch_size, 0.2)
                records = [r for r in records
                           if r.position.offset < ends[(r.position.topic, r.position.partition)]]
                if records:
                    batch = await apply_batch(conn, records, codec, keep=keep)
                    records_seen += len(records)
                    applied += sum(batch.applied.values())
                    undecodable += len(batch.parked)
                    bar.update(len(records))
                # Transaction markers are never delivered: the position says when done.
                reached = await consumer.positions(list(remaining))
                for tp, position in reached.items():
                    if position >= remaining[tp]:
                        del remaining[tp]
            # The rebuilt store's positions are the ends read to, so a projector pointed
            # at it carries on from there.
            async with conn.transaction():
                await store_positions(conn, ends)
        bar.close()
    finally:
        await consumer.close()
    return ReplayStats(records_seen, applied, records_seen - applied - undecodable,
                       undecodable, time.perf_counter() - started)


def _count_to_read(consumer: LogReader, ends: dict[tuple[str, int], int]) -> int:
    return sum(end - consumer.watermarks_sync(t, p)[0] for (t, p), end in ends.items())


def run_replay(bootstrap: str, database_url: str, codec: Codec, schema: str | None,
               until: datetime | None) -> ReplayStats:
    return asyncio.run(replay(bootstrap, database_url, codec, schema=schema, until=until))
