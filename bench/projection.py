"""``pipeline bench projection``: how fast the projector and a replay write the store.

It needs a running stack (``pipeline infra up``) and touches nothing of the live
pipeline: it creates scratch topics and schemas, and deletes them afterwards. It
writes synthetic turns (model ``bench-synthetic``): each a PromptSubmitted, a
GenerationStarted, ``deltas`` TokenDeltas and a GenerationFinished. A projector in
this process, in a group of its own, projects them into one scratch schema: the
figure is how long the store takes to reach the log's end. Then a replay rebuilds
the same log into another scratch schema, timed on its own.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from prometheus_client import CollectorRegistry
from psycopg import sql

from pipeline.codec import CLEAR, Position, key_of
from pipeline.kafka import EventProducer, LogReader, delete_topics, ensure_topics
from pipeline.topics import TopicSpec
from projections.migrate import in_schema, migrate
from projections.projector import Projector
from projections.replay import replay
from projections.settings import ProjectorSettings
from schemas import (
    ChatMessage,
    Event,
    EventIds,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
    Usage,
)

MODEL = "bench-synthetic"


@dataclass(frozen=True)
class ProjectionFigures:
    turns: int
    partitions: int
    events: int
    produce_events_per_s: float
    projector_events_per_s: float
    projector_seconds: float
    replay_records: int
    replay_events_per_s: float
    measured_at: str


async def produce_turns(producer: EventProducer, topics: tuple[str, str], turns: int,
                        deltas: int, events_per_s: float | None = None) -> int:
    """Synthetic turns (each a prompt, a start, ``deltas`` deltas and an end), at most
    ``events_per_s`` if given; returns the events written, once all are acknowledged."""
    prompts, generations = topics
    sent = 0
    futures = []

    def put(topic: str, event: Event) -> asyncio.Future[Position]:
        # Synthetic content, in the clear: no keyring is read or written here.
        return producer.send_raw(topic, key_of(event), CLEAR.encode(event))

    started = time.perf_counter()
    for i in range(turns):
        ids = EventIds(conversation_id=uuid.uuid4(), request_id=f"bench-{uuid.uuid4().hex}")
        futures.append(put(prompts, PromptSubmitted(
            **ids, model=MODEL,
            messages=(ChatMessage(role="user", content=f"synthetic turn {i}"),))))
        futures.append(put(generations, GenerationStarted(
            **ids, model=MODEL, worker="bench", reply_seq=1, prompt_tokens=12)))
        for seq in range(deltas):
            futures.append(put(generations, TokenDelta(**ids, seq=seq, text=" tok")))
        futures.append(put(generations, GenerationFinished(
            **ids, model=MODEL, reply_seq=1, finish_reason="length", text=" tok" * deltas,
            usage=Usage(prompt_tokens=12, completion_tokens=deltas), deltas=deltas,
            ttft_ms=50.0, duration_ms=500.0)))
        sent += deltas + 3
        if events_per_s is not None:
            ahead = sent / events_per_s - (time.perf_counter() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
        if len(futures) > 20_000:
            await asyncio.gather(*futures)
            futures.clear()
    await asyncio.gather(*futures)
    return sent


async def _log_end(bootstrap: str, topics: tuple[str, str]) -> dict[tuple[str, int], int]:
    consumer = LogReader(bootstrap, f"bench-{uuid.uuid4().hex[:8]}", "bench")
    try:
        def ends() -> dict[tuple[str, int], int]:
            return {(t, p): consumer.watermarks_sync(t, p)[1]
                    for t in topics for p in consumer.partitions_sync(t)}
        return await consumer.call(ends)
    finally:
        await consumer.close()


async def _wait_projected(database_url: str, ends: dict[tuple[str, int], int],
                          within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        while True:
            rows = await (await conn.execute(
                "SELECT topic, partition, next_offset FROM projector_positions")).fetchall()
            stored = {(t, p): o for t, p, o in rows}
            if all(stored.get(tp, 0) >= end for tp, end in ends.items() if end):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the projection did not reach the log's end")
            await asyncio.sleep(0.02)


async def bench_projection(bootstrap: str, database_url: str, turns: int,
                           deltas: int, partitions: int) -> ProjectionFigures:
    run_id = uuid.uuid4().hex[:8]
    topics = (f"bench.{run_id}.prompts", f"bench.{run_id}.generations")
    live, rebuilt = f"bench_{run_id}", f"bench_{run_id}_replay"
    ensure_topics(bootstrap, [TopicSpec(t, partitions, {}) for t in topics])
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(live)))
        migrate(database_url, schema=live)
        live_url = in_schema(database_url, live)
        stop = asyncio.Event()
        projector = Projector(ProjectorSettings(), bootstrap, live_url, CollectorRegistry(),
                              topics=topics, group=f"bench-projector-{run_id}")
        task = asyncio.create_task(projector.run(stop))
        try:
            producer = EventProducer(bootstrap, linger_ms=5)
            started = time.perf_counter()
            events = await produce_turns(producer, topics, turns, deltas)
            produced = time.perf_counter() - started
            producer.close()
            await _wait_projected(live_url, await _log_end(bootstrap, topics), within_s=600)
            projected = time.perf_counter() - started
        finally:
            stop.set()
            await task
        stats = await replay(bootstrap, database_url, CLEAR, schema=rebuilt, topics=topics)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            for schema in (live, rebuilt):
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(schema)))
        delete_topics(bootstrap, list(topics))
    return ProjectionFigures(
        turns=turns, partitions=partitions, events=events, produce_events_per_s=events / produced,
        projector_events_per_s=events / projected, projector_seconds=projected,
        replay_records=stats.records, replay_events_per_s=stats.rate,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )


def report(figures: ProjectionFigures, out_dir: Path) -> str:
    table = "\n".join([
        "| figure | value |",
        "|---|---|",
        f"| synthetic turns written | {figures.turns:,} ({figures.events:,} events) |",
        f"| produce rate (acks=all) | {figures.produce_events_per_s:,.0f} events/s |",
        f"| projector, log end reached after | {figures.projector_seconds:.1f} s |",
        f"| projector sustained rate | {figures.projector_events_per_s:,.0f} events/s |",
        f"| replay of the whole log | {figures.replay_records:,} records at "
        f"{figures.replay_events_per_s:,.0f} events/s |",
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "projection.json").write_text(json.dumps(asdict(figures), indent=2) + "\n")
    (out_dir / "projection.md").write_text(
        f"# Projection benchmark ({figures.measured_at})\n\n{table}\n\n"
        f"Measured with `pipeline bench projection --turns {figures.turns}` on one machine\n"
        "(2 cores) shared by the broker, PostgreSQL and the bench, in scratch topics\n"
        f"({figures.partitions} partitions) and schemas that it deletes afterwards.\n")
    return table


def run(bootstrap: str, database_url: str, turns: int, deltas: int, partitions: int,
        out_dir: Path) -> str:
    figures = asyncio.run(bench_projection(bootstrap, database_url, turns, deltas, partitions))
    return report(figures, out_dir)
