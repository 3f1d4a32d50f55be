"""``pipeline analytics``: usage and quality figures per tenant, model and minute, kept
live from ``chat.prompts`` and ``chat.generations`` by a faust-streaming application in
a consumer group of its own, written to PostgreSQL and exported to Prometheus.

Per minute (``analytics_minutes`` and its neighbours, migration 006): turns started,
finished, cancelled and failed (by code), prompt and completion tokens, TTFT and
inter-token latency sketches (``schemas.sketch``: mergeable, so minutes add up to
hours), and the sessions with a turn started.

**Exact under faults, without faust's exactly-once mode** (its open duplicate and crash
bugs): records arrive at least once, read committed, and every write is idempotent,
keyed by the turn. Each fact about a turn (its prompt, its start, its first token, its
end) is written to ``analytics_turns`` only where still NULL, and the minute tables are
added to in the same transaction that first sets the fact the addition depends on: a
turn's start is counted when ``started_at`` is first set, its end when ``counted`` is
first set, which needs both its prompt and its terminal event (they are in different
topics, so either may come first). A record delivered again (after a crash, before
faust committed its offset; or to a second consumer during a rebalance) finds the facts
set and adds nothing. Keying by turn rather than by position also makes the figures
independent of how partitions are assigned: any number of processes, in one group,
give the same tables as one process reading from the start.

What a turn counts as:

* **started**: its first ``GenerationStarted`` (a turn resumed by another worker is one
  turn), in the minute it occurred, with the session it belongs to.
* **finished / cancelled / failed**: its first terminal event: ``GenerationFinished``
  (``stop``/``length`` finished; ``abort`` cancelled) or ``GenerationFailed`` (with its
  code), in the minute it occurred, under the tenant and the model of its prompt. (A
  turn's tenant, model and session come from its prompt only, never from whichever
  event happened to be read first: the result must not depend on the order between
  topics.)
* **tokens**: the terminal event's usage.
* **TTFT**: the prompt's ``occurred_at`` (the gateway accepting it) to the first token's
  (the worker writing it: its first ``GenerationStarted``, written at the first token;
  in logs from before the live stream, its ``TokenDelta`` of seq 0): what a client
  waits, queueing included. Clocks of different hosts are compared here: keep them in
  NTP sync.
* **inter-token latency**: the worker's decode time after the first token over the
  tokens that followed it (vLLM's TPOT), per turn with at least two tokens.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import DecodeError, parse
from pipeline.metrics import LATENCY_BUCKETS, OTHER, LabelCap
from pipeline.projecting import until_taken
from pipeline.retry import Backoff
from projections.projector import caused_by_event
from schemas import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
)
from schemas.sketch import bin_of

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a batch is tried again for: the database away, or refusing for a moment.
RETRYABLE = (psycopg.OperationalError, psycopg.InterfaceError,
             psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)
# How far back "active sessions" looks, for the gauge.
ACTIVE_WINDOW_MINUTES = 5


def minute_of(at: datetime) -> datetime:
    return at.replace(second=0, microsecond=0)


class AnalyticsMetrics:
    """What the analytics consumer exports. The turn and token counters move once per
    turn (as the tables do), so their rates are usage as the log tells it.

    Tenants, models and failure codes come from the records, an open set: each label
    has its own series for at most ``series_per_label`` values (``LabelCap``), and the
    rest share ``OTHER``. The tables keep every tenant; Prometheus keeps a bounded
    view of them."""

    def __init__(self, registry: CollectorRegistry, series_per_label: int = 100) -> None:
        self.tenant = LabelCap(series_per_label)
        self.model = LabelCap(series_per_label)
        self.code = LabelCap(series_per_label)
        Gauge("analytics_labelled_tenants",
              "Tenants with series of their own; past ANALYTICS_SERIES_PER_LABEL the rest "
              "are counted under tenant=\"(other)\"", registry=registry
              ).set_function(lambda: self.tenant.kept)
        self.turns = Counter("analytics_turns", "Turns by outcome (started counts starts)",
                             ["tenant", "model", "outcome"], registry=registry)
        self.failures = Counter("analytics_failures", "Failed turns by code",
                                ["tenant", "model", "code"], registry=registry)
        self.tokens = Counter("analytics_tokens", "Tokens by kind (prompt, completion)",
                              ["tenant", "model", "kind"], registry=registry)
        self.ttft = Histogram("analytics_ttft_seconds",
                              "Prompt accepted to first token written, queueing included",
                              ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("analytics_itl_seconds",
                             "Decode time per token after the first, per turn",
                             ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.active_sessions = Gauge(
            "analytics_active_sessions",
            f"Sessions with a turn started in the last {ACTIVE_WINDOW_MINUTES} minutes",
            ["tenant"], registry=registry)
        self.events = Counter("analytics_events", "Records read, by topic", ["topic"],
                              registry=registry)
        self.dead_letters = Counter("analytics_dead_letters",
                                    "Records that did not decode, sent to the dead-letter topic",
                                    registry=registry)
        self.lag_events = Gauge("analytics_lag_events",
                                "Records in the assigned partitions not yet applied",
                                registry=registry)
        self.batch_seconds = Histogram("analytics_batch_seconds",
                                       "Time to apply one batch in one transaction",
                                       registry=registry)
        self.repeats = Counter("analytics_repeated_events",
                               "Events whose facts were already stored (delivered again "
                               "after a restart or a rebalance): they add nothing",
                               registry=registry)
        self.retries = Counter("analytics_retries",
                               "Batches retried after a database error", registry=registry)


@dataclass
class _Minute:
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Additions:
    """What one batch adds to the minute tables (summed in memory, written sorted, so
    two consumers writing at once take row locks in the same order)."""

    minutes: dict[tuple[str, datetime, str], _Minute] = field(
        default_factory=lambda: defaultdict(_Minute))
    failures: dict[tuple[str, datetime, str, str], int] = field(
        default_factory=lambda: defaultdict(int))
    latency: dict[tuple[str, datetime, str, str, int], int] = field(
        default_factory=lambda: defaultdict(int))
    sessions: set[tuple[str, datetime, str, Any]] = field(default_factory=set)
    # For the Prometheus side, applied once the transaction commits.
    observed: list[tuple[str, str, float]] = field(default_factory=list)  # metric, model, s
    outcomes: list[tuple[str, str, str, str | None, int, int]] = field(default_factory=list)
    repeats: int = 0  # events whose facts were already in: delivered again


_TURN_COLUMNS = ("tenant, model, conversation_id, submitted_at, started_at, first_token_at, "
                 "ended_at, outcome, code, prompt_tokens, completion_tokens, decode_ms")


async def _set_facts(cur: psycopg.AsyncCursor[Any], request_id: str, guard: str,
                     **facts: Any) -> bool:
    """Set ``facts`` on the turn where ``guard`` (a column) is still NULL; True if this
    call set them (the first delivery of the event that carries them)."""
    names = list(facts)
    cols = ", ".join(["request_id", *names])
    marks = ", ".join(["%s"] * (len(names) + 1))
    # COALESCE: a fact another event already gave (a model, a tenant) is kept.
    sets = ", ".join(f"{n} = COALESCE(analytics_turns.{n}, EXCLUDED.{n})" for n in names)
    await cur.execute(
        f"INSERT INTO analytics_turns ({cols}) VALUES ({marks}) ON CONFLICT (request_id) "
        f"DO UPDATE SET {sets} WHERE analytics_turns.{guard} IS NULL RETURNING 1",
        [request_id, *facts.values()])
    return await cur.fetchone() is not None


async def _count_end(cur: psycopg.AsyncCursor[Any], request_id: str, adds: Additions) -> None:
    """Add the turn's end to the minute tables, once: when both its prompt and its
    terminal event are in (whichever came second calls this to effect)."""
    await cur.execute(
        f"UPDATE analytics_turns SET counted = true WHERE request_id = %s AND NOT counted"
        f" AND submitted_at IS NOT NULL AND ended_at IS NOT NULL RETURNING {_TURN_COLUMNS}",
        [request_id])
    row = await cur.fetchone()
    if row is None:
        return
    (tenant, model, _conv, submitted_at, _started, first_token_at, ended_at, outcome, code,
     prompt_tokens, completion_tokens, decode_ms) = row
    minute = minute_of(ended_at)
    counts = adds.minutes[(tenant, minute, model)]
    setattr(counts, outcome, getattr(counts, outcome) + 1)
    counts.prompt_tokens += prompt_tokens or 0
    counts.completion_tokens += completion_tokens or 0
    if outcome == "failed":
        adds.failures[(tenant, minute, model, code or "unknown")] += 1
    if first_token_at is not None:
        ttft_ms = max((first_token_at - submitted_at).total_seconds() * 1000, 0.0)
        adds.latency[(tenant, minute, model, "ttft", bin_of(ttft_ms))] += 1
        adds.observed.append(("ttft", model, ttft_ms / 1000))
    if decode_ms is not None and (completion_tokens or 0) >= 2:
        itl_ms = decode_ms / (completion_tokens - 1)
        adds.latency[(tenant, minute, model, "itl", bin_of(itl_ms))] += 1
        adds.observed.append(("itl", model, itl_ms / 1000))
    adds.outcomes.append((tenant, model, outcome, code, prompt_tokens or 0,
                          completion_tokens or 0))


async def _fold(cur: psycopg.AsyncCursor[Any], event: Event, adds: Additions) -> None:
    rid = event.request_id
    if isinstance(event, PromptSubmitted):
        new = await _set_facts(cur, rid, "submitted_at", tenant=event.tenant,
                               model=event.model, conversation_id=event.conversation_id,
                               submitted_at=event.occurred_at)
        if new:
            await _count_end(cur, rid, adds)
    elif isinstance(event, GenerationStarted):
        # A start of v2 is written at the turn's first token (its deltas are in the live
        # stream, which analytics does not read); one of v1, beside its TokenDelta events.
        first_token = {} if event.ref is None else {"first_token_at": event.occurred_at}
        new = await _set_facts(cur, rid, "started_at", started_at=event.occurred_at,
                               **first_token)
        if new:
            minute = minute_of(event.occurred_at)
            # The model that runs it (the prompt's, unless a worker refused it).
            adds.minutes[(event.tenant, minute, event.model)].started += 1
            adds.sessions.add((event.tenant, minute, event.model, event.conversation_id))
            adds.outcomes.append((event.tenant, event.model, "started", None, 0, 0))
    elif isinstance(event, TokenDelta):
        if event.seq != 0:
            return
        new = await _set_facts(cur, rid, "first_token_at", first_token_at=event.occurred_at)
    elif isinstance(event, GenerationFinished):
        outcome = "cancelled" if event.finish_reason == "abort" else "finished"
        decode_ms = (event.duration_ms - event.ttft_ms) if event.ttft_ms is not None else None
        new = await _set_facts(cur, rid, "ended_at", ended_at=event.occurred_at,
                               outcome=outcome,
                               prompt_tokens=event.usage.prompt_tokens,
                               completion_tokens=event.usage.completion_tokens,
                               decode_ms=decode_ms)
        if new:
            await _count_end(cur, rid, adds)
    elif isinstance(event, GenerationFailed):
        new = await _set_facts(cur, rid, "ended_at", ended_at=event.occurred_at,
                               outcome="failed", code=event.code, prompt_tokens=0,
                               completion_tokens=0)
        if new:
            await _count_end(cur, rid, adds)
    else:
        return
    adds.repeats += not new


async def _write(cur: psycopg.AsyncCursor[Any], adds: Additions) -> None:
    if adds.minutes:
        await cur.executemany(
            "INSERT INTO analytics_minutes AS m (tenant, minute, model, started, finished,"
            " cancelled, failed, prompt_tokens, completion_tokens)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (tenant, minute, model)"
            " DO UPDATE SET started = m.started + EXCLUDED.started,"
            " finished = m.finished + EXCLUDED.finished,"
            " cancelled = m.cancelled + EXCLUDED.cancelled, failed = m.failed + EXCLUDED.failed,"
            " prompt_tokens = m.prompt_tokens + EXCLUDED.prompt_tokens,"
            " completion_tokens = m.completion_tokens + EXCLUDED.completion_tokens",
            [(*key, c.started, c.finished, c.cancelled, c.failed, c.prompt_tokens,
              c.completion_tokens) for key, c in sorted(adds.minutes.items())])
    if adds.failures:
        await cur.executemany(
            "INSERT INTO analytics_failures AS f (tenant, minute, model, code, turns)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant, minute, model, code)"
            " DO UPDATE SET turns = f.turns + EXCLUDED.turns",
            [(*key, n) for key, n in sorted(adds.failures.items())])
    if adds.latency:
        await cur.executemany(
            "INSERT INTO analytics_latency AS l (tenant, minute, model, metric, bin, turns)"
            " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (tenant, minute, model, metric, bin)"
            " DO UPDATE SET turns = l.turns + EXCLUDED.turns",
            [(*key, n) for key, n in sorted(adds.latency.items())])
    if adds.sessions:
        await cur.executemany(
            "INSERT INTO analytics_sessions (tenant, minute, model, conversation_id)"
            " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING", sorted(adds.sessions, key=str))


def decode_all(values: Iterable[bytes | None]) -> list[Event | DecodeError]:
    """The events of ``values``, their content left sealed: analytics count, never read."""
    out: list[Event | DecodeError] = []
    for value in values:
        try:
            out.append(parse(value))
        except DecodeError as exc:
            out.append(exc)
    return out


class AnalyticsStore:
    """Applies batches of events to the analytics tables (see the module), each batch in
    one transaction, retried as a whole while the database refuses it."""

    def __init__(self, database_url: str, metrics: AnalyticsMetrics) -> None:
        self.database_url = database_url
        self.metrics = metrics
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self.database_url,
                                                               autocommit=True)
        return self._conn

    async def apply(self, items: Sequence[tuple[T, Event]]) -> list[tuple[T, str]]:
        """Apply the events of ``items`` (in log order per partition); returns, once they
        are stored, the items whose event the tables refuse for what it holds (a NUL in
        a tenant, a count past a column's range: ``caused_by_event``), with the reason,
        for the dead-letter topic. Any other database error is retried until it passes
        (``pipeline.projecting.until_taken``)."""
        return await until_taken(functools.partial(self._apply_once, items), RETRYABLE,
                                 self._retrying, Backoff(0.2, 10.0))

    async def _apply_once(self, items: Sequence[tuple[T, Event]]) -> list[tuple[T, str]]:
        try:
            await self._apply_batch([event for _, event in items])
            return []
        except psycopg.Error as exc:
            if not caused_by_event(exc):
                raise
            return await self._apply_each(items)

    async def _retrying(self, exc: BaseException, delay: float) -> None:
        self.metrics.retries.inc()
        log.warning("could not write analytics (%s); retrying in %.1f s", exc, delay)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    async def _apply_batch(self, events: Sequence[Event]) -> None:
        started = time.monotonic()
        adds = Additions()
        conn = await self._connection()
        async with conn.transaction(), conn.cursor() as cur:
            for event in events:
                await _fold(cur, event, adds)
            await _write(cur, adds)
        self.metrics.batch_seconds.observe(time.monotonic() - started)
        self._export(adds)

    async def _apply_each(self, items: Sequence[tuple[T, Event]]) -> list[tuple[T, str]]:
        """The batch again, one event at a time, each in a savepoint of one transaction;
        those the tables refuse are left out."""
        parked: list[tuple[T, str]] = []
        done: list[Additions] = []
        conn = await self._connection()
        async with conn.transaction(), conn.cursor() as cur:
            for item, event in items:
                adds = Additions()
                try:
                    async with conn.transaction():
                        await _fold(cur, event, adds)
                        await _write(cur, adds)
                except psycopg.Error as exc:
                    if not caused_by_event(exc):
                        raise
                    parked.append((item, f"the analytics tables refuse it: {exc}"[:500]))
                    continue
                done.append(adds)
        for adds in done:
            self._export(adds)
        return parked

    def _export(self, adds: Additions) -> None:
        m = self.metrics
        m.repeats.inc(adds.repeats)
        for tenant_of, model_of, outcome, code, prompt, completion in adds.outcomes:
            tenant, model = m.tenant(tenant_of), m.model(model_of)
            m.turns.labels(tenant, model, outcome).inc()
            if code is not None:
                m.failures.labels(tenant, model, m.code(code)).inc()
            if prompt:
                m.tokens.labels(tenant, model, "prompt").inc(prompt)
            if completion:
                m.tokens.labels(tenant, model, "completion").inc(completion)
        for metric, model_of, seconds in adds.observed:
            (m.ttft if metric == "ttft" else m.itl).labels(m.model(model_of)).observe(seconds)

    async def refresh_active_sessions(self) -> None:
        conn = await self._connection()
        gauge, limit = self.metrics.active_sessions, self.metrics.tenant.limit
        # The busiest tenants by name, the rest as one sum: a bounded answer however
        # many tenants were active (a conversation is one tenant's, so the sums add up).
        rows = await (await conn.execute(
            "WITH active AS (SELECT tenant, count(DISTINCT conversation_id) AS n"
            " FROM analytics_sessions"
            " WHERE minute >= date_trunc('minute', now()) - make_interval(mins => %s)"
            " GROUP BY tenant), ranked AS (SELECT tenant, n,"
            " row_number() OVER (ORDER BY n DESC, tenant) <= %s AS named FROM active)"
            " SELECT CASE WHEN named THEN tenant END, sum(n)::bigint FROM ranked"
            " GROUP BY 1", [ACTIVE_WINDOW_MINUTES - 1, limit])).fetchall()
        gauge.clear()
        for tenant, sessions in rows:
            gauge.labels(OTHER if tenant is None else tenant).set(sessions)

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
