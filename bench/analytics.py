"""``pipeline bench analytics``: events per second through the analytics consumer, and
its lag while the log grows at the pipeline's peak rate.

It needs a running stack (``pipeline infra up``) and touches nothing of the live
pipeline: scratch topics and a scratch schema, deleted afterwards, and an analytics
process (``pipeline analytics``) in a group of its own reading them.

1. **Catch-up**: synthetic turns (``bench.projection.produce_turns``: a prompt, a start,
   ``deltas`` token deltas and an end each) are written first; then the consumer starts
   and reads them all. Events per second: the slope of its ``analytics_events_total``
   from its first event to its last.
2. **At the peak rate**: synthetic turns written at the highest deltas/s the pipeline
   delivered in ``pipeline bench capacity`` (docs/benchmarks/capacity.json; one event
   per token, as a worker that does not coalesce writes them), while the consumer
   follows; its lag (``analytics_lag_events``) sampled every 0.25 s, and how long after
   the last write it had applied everything.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
from psycopg import sql

from bench.projection import produce_turns
from infra.process import free_port
from pipeline.kafka import EventProducer, delete_topics, ensure_topics
from pipeline.topics import TopicSpec

DEFAULT_PEAK_EVENTS_PER_S = 2_600.0  # capacity.json's best, when it is not there


@dataclass(frozen=True)
class AnalyticsFigures:
    partitions: int
    catchup_events: int
    catchup_events_per_s: float
    peak_events_per_s_offered: float
    peak_events_per_s_written: float
    peak_seconds: float
    lag_events_p50: float
    lag_events_p99: float
    lag_events_max: float
    drained_after_last_write_s: float
    measured_at: str


def peak_rate(capacity_json: Path) -> float:
    try:
        figures = json.loads(capacity_json.read_text())
        return max(float(r["deltas_per_s"]) for r in figures["delta_latency"])
    except (OSError, ValueError, KeyError):
        return DEFAULT_PEAK_EVENTS_PER_S


def _scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
    return out


class _Consumer:
    """``pipeline analytics`` on the scratch topics, as its own process."""

    def __init__(self, bootstrap: str, database_url: str, topics: tuple[str, str],
                 schema: str, logs: Path) -> None:
        self.port = free_port()
        logs.mkdir(parents=True, exist_ok=True)
        self.log = logs / f"analytics-{schema}.log"
        env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": bootstrap,
               "DATABASE_URL": database_url, "ANALYTICS_TOPICS": ",".join(topics)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch", "analytics", "--group", schema, "--schema",
                 schema, "--metrics-port", str(self.port)], env=env, stdout=out,
                stderr=subprocess.STDOUT)

    def events(self) -> float:
        try:
            return _scrape(f"http://127.0.0.1:{self.port}/metrics").get(
                "analytics_events_total", 0.0)
        except httpx.HTTPError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the analytics process exited: see {self.log}") from None
            return 0.0

    def lag(self) -> float:
        return _scrape(f"http://127.0.0.1:{self.port}/metrics").get("analytics_lag_events", 0.0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_events(consumer: _Consumer, total: int, within_s: float) -> list[tuple[float, float]]:
    """(time, events read) samples until the consumer has read ``total`` events."""
    samples = []
    deadline = time.monotonic() + within_s
    while True:
        now, seen = time.monotonic(), consumer.events()
        samples.append((now, seen))
        if seen >= total:
            return samples
        if now > deadline:
            raise TimeoutError(f"analytics read {seen:.0f} of {total} events")
        time.sleep(0.25)


def bench_analytics(bootstrap: str, database_url: str, partitions: int, catchup_turns: int,
                    peak_s: float, peak_events_per_s: float, logs: Path) -> AnalyticsFigures:
    run_id = uuid.uuid4().hex[:8]
    schema = f"bench_analytics_{run_id}"
    topics = (f"bench.{run_id}.prompts", f"bench.{run_id}.generations")
    deltas = 32
    ensure_topics(bootstrap, [TopicSpec(t, partitions, {}) for t in topics])
    consumer: _Consumer | None = None
    try:
        producer = EventProducer(bootstrap, linger_ms=5)
        written = asyncio.run(produce_turns(producer, topics, catchup_turns, deltas))
        print(f"catch-up: {written:,} events written; starting the consumer", flush=True)
        consumer = _Consumer(bootstrap, database_url, topics, schema, logs)
        samples = _wait_events(consumer, written, within_s=900)
        moving = [(t, n) for t, n in samples if n > 0]
        (t0, n0), (t1, n1) = moving[0], moving[-1]
        catchup_rate = (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")
        print(f"catch-up: {catchup_rate:,.0f} events/s", flush=True)

        turns = max(int(peak_events_per_s * peak_s / (deltas + 3)), 1)
        lags: list[float] = []
        done = False

        async def sample() -> None:
            while not done:
                lags.append(await asyncio.to_thread(consumer.lag))
                await asyncio.sleep(0.25)

        async def paced() -> tuple[int, float]:
            nonlocal done
            sampler = asyncio.create_task(sample())
            started = time.perf_counter()
            n = await produce_turns(producer, topics, turns, deltas, peak_events_per_s)
            took = time.perf_counter() - started
            done = True
            await sampler
            return n, took

        print(f"peak: writing {peak_events_per_s:,.0f} events/s for ~{peak_s:.0f} s",
              flush=True)
        peak_written, peak_took = asyncio.run(paced())
        last_write = time.monotonic()
        _wait_events(consumer, written + peak_written, within_s=600)
        drained = time.monotonic() - last_write
        producer.close()
    finally:
        if consumer is not None:
            consumer.stop()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))
        delete_topics(bootstrap, list(topics))
    ordered = sorted(lags) or [0.0]
    return AnalyticsFigures(
        partitions=partitions, catchup_events=written, catchup_events_per_s=catchup_rate,
        peak_events_per_s_offered=peak_events_per_s,
        peak_events_per_s_written=peak_written / peak_took, peak_seconds=peak_took,
        lag_events_p50=statistics.median(ordered),
        lag_events_p99=ordered[min(int(0.99 * len(ordered)), len(ordered) - 1)],
        lag_events_max=ordered[-1], drained_after_last_write_s=drained,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"))


def report(f: AnalyticsFigures, out_dir: Path, quick: bool) -> str:
    table = "\n".join([
        "| figure | value |",
        "|---|---|",
        f"| catch-up: events read and applied | {f.catchup_events:,} at "
        f"{f.catchup_events_per_s:,.0f} events/s |",
        f"| peak: events/s offered (the pipeline's best deltas/s) / written | "
        f"{f.peak_events_per_s_offered:,.0f} / {f.peak_events_per_s_written:,.0f} for "
        f"{f.peak_seconds:.0f} s |",
        f"| peak: consumer lag p50 / p99 / max (events) | {f.lag_events_p50:,.0f} / "
        f"{f.lag_events_p99:,.0f} / {f.lag_events_max:,.0f} |",
        f"| peak: everything applied after the last write | "
        f"{f.drained_after_last_write_s:.1f} s |",
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "analytics.json").write_text(json.dumps(asdict(f), indent=2) + "\n")
    (out_dir / "analytics.md").write_text(
        f"# Analytics consumer ({f.measured_at})\n\n{table}\n\n"
        f"Measured with `pipeline bench analytics{' --quick' if quick else ''}` on one "
        f"machine (2 cores) shared by the broker, PostgreSQL, the producer and the "
        f"consumer, in scratch topics ({f.partitions} partitions) and a scratch schema "
        "deleted afterwards. Synthetic turns of 32 token deltas; the lag is the "
        "consumer's own gauge (records in its partitions not yet applied), sampled "
        "every 0.25 s.\n")
    return table


def run(bootstrap: str, database_url: str, partitions: int, quick: bool, out_dir: Path,
        logs: Path) -> str:
    figures = bench_analytics(
        bootstrap, database_url, partitions, catchup_turns=500 if quick else 3_000,
        peak_s=15 if quick else 60,
        peak_events_per_s=peak_rate(Path("docs/benchmarks/capacity.json")), logs=logs)
    return report(figures, out_dir, quick)
