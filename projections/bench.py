"""``pipeline bench projection``: how fast the projector and a replay write the store.

It needs a running stack (``pipeline infra up``). It writes synthetic turns (model
``bench-synthetic``, labelled as such) to the live topics: each turn is a
PromptSubmitted, a GenerationStarted, ``deltas`` TokenDeltas and a GenerationFinished.
It runs a projector in this process (in group ``projector``: any other projector
running shares the work), times how long the store takes to reach the log's end,
then replays the whole log into a scratch schema and times that, and drops it.
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

from pipeline.kafka import AsyncConsumer, EventProducer
from pipeline.settings import ProjectorSettings
from pipeline.topics import GENERATIONS, PROMPTS
from projections.projector import Projector
from projections.replay import replay
from schemas import (
    ChatMessage,
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
    events: int
    produce_events_per_s: float
    projector_events_per_s: float
    projector_seconds: float
    replay_records: int
    replay_events_per_s: float
    measured_at: str


async def _produce(producer: EventProducer, turns: int, deltas: int) -> int:
    sent = 0
    futures = []
    for i in range(turns):
        ids = EventIds(conversation_id=uuid.uuid4(), request_id=f"bench-{uuid.uuid4().hex}")
        futures.append(producer.send(PROMPTS, PromptSubmitted(
            **ids, model=MODEL,
            messages=(ChatMessage(role="user", content=f"synthetic turn {i}"),))))
        futures.append(producer.send(GENERATIONS, GenerationStarted(
            **ids, model=MODEL, worker="bench", reply_seq=1, prompt_tokens=12)))
        for seq in range(deltas):
            futures.append(producer.send(GENERATIONS, TokenDelta(**ids, seq=seq, text=" tok")))
        futures.append(producer.send(GENERATIONS, GenerationFinished(
            **ids, model=MODEL, reply_seq=1, finish_reason="length", text=" tok" * deltas,
            usage=Usage(prompt_tokens=12, completion_tokens=deltas), deltas=deltas,
            ttft_ms=50.0, duration_ms=500.0)))
        sent += deltas + 3
        if len(futures) > 20_000:
            await asyncio.gather(*futures)
            futures.clear()
    await asyncio.gather(*futures)
    return sent


async def _log_end(bootstrap: str) -> dict[tuple[str, int], int]:
    consumer = AsyncConsumer(bootstrap, f"bench-{uuid.uuid4().hex[:8]}")
    try:
        def ends() -> dict[tuple[str, int], int]:
            return {(t, p): consumer.watermarks_sync(t, p)[1]
                    for t in (PROMPTS, GENERATIONS) for p in consumer.partitions_sync(t)}
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
                           deltas: int) -> ProjectionFigures:
    stop = asyncio.Event()
    projector = Projector(ProjectorSettings(), bootstrap, database_url, CollectorRegistry())
    task = asyncio.create_task(projector.run(stop))
    try:
        await _wait_projected(database_url, await _log_end(bootstrap), within_s=120)
        await asyncio.sleep(2)  # let the group settle with this projector in it
        producer = EventProducer(bootstrap, linger_ms=5)
        started = time.perf_counter()
        events = await _produce(producer, turns, deltas)
        produced = time.perf_counter() - started
        producer.close()
        await _wait_projected(database_url, await _log_end(bootstrap), within_s=600)
        projected = time.perf_counter() - started
    finally:
        stop.set()
        await task

    schema = f"bench_replay_{uuid.uuid4().hex[:8]}"
    try:
        stats = await replay(bootstrap, database_url, schema=schema)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))
    return ProjectionFigures(
        turns=turns, events=events, produce_events_per_s=events / produced,
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
        "Measured with `pipeline bench projection` on one machine (2 cores) with the\n"
        "broker, PostgreSQL and the bench sharing it.\n")
    return table


def run(bootstrap: str, database_url: str, turns: int, deltas: int, out_dir: Path) -> str:
    figures = asyncio.run(bench_projection(bootstrap, database_url, turns, deltas))
    return report(figures, out_dir)
