"""The projector: reads both chat topics in group ``projector`` and keeps Postgres in step.

Exactly-once effect: each batch of events is applied in one transaction that also
records, per partition, the next offset to read. On assignment the projector seeks
to those stored positions, so a crash at any point neither loses nor repeats rows.

It projects ``chat.keys`` too, into the index of data keys (``projections.keys``), and
destroys a deleted or erased conversation's keys before the batch holding its
``SessionDeleted`` commits (or holding a key made for it after its deletion): it writes
their tombstones and the conversation's erasure (``pipeline.erasures``). The gateway or
``pipeline erase`` that wrote the deletion erases the conversation at once, but may die
before, and this makes the deletion alone enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import CLEAR, TP, Codec, DecodeError
from pipeline.deadletter import dead_letter
from pipeline.kafka import (
    BEGINNING,
    EventProducer,
    GroupConsumer,
    KafkaException,
    ProduceError,
    Record,
)
from pipeline.kek import parse_record_key
from pipeline.keylimits import KeyringError
from pipeline.keystore import Keyring
from pipeline.projecting import Rounds, run_projection
from pipeline.retry import Backoff, QuietLog
from pipeline.topics import KEYS, STORE_TOPICS
from projections.keys import DOOMED, DROP, key_writes
from projections.projection import Write, project
from projections.settings import ProjectorSettings
from schemas import Event, PromptSubmitted, SessionDeleted
from schemas.conversation import TurnLedger, Verdict

log = logging.getLogger(__name__)
# SQLSTATE classes an event's content can cause: data exceptions (22: a number out of
# range, text Postgres cannot hold), integrity violations (23) and program limits (54: an
# index row too large, JSON nested too deep). Such an event is dead-lettered. Any other
# error (the connection lost, a missing table, a full disk) is not the event's fault: the
# batch is retried, with backoff, until the database takes it.
EVENT_SQLSTATE_CLASSES = ("22", "23", "54")
RETRY_MIN_S, RETRY_MAX_S = 0.2, 10.0
# How long an idle projector waits for a record per poll.
IDLE_WAIT_S = 0.1
# How often the positions the consumer moved past records it never delivers (transaction
# markers, aborted records) are stored: the stored positions reach the end of the log by
# then, which ``GET /v1/sessions`` waits for.
SKIPPED_INTERVAL_S = 0.1
# How often the consumed positions are mirrored into Kafka and the lag is measured:
# each is a request the broker pays for, and they only feed lag tools and metrics.
REPORT_INTERVAL_S = 1.0
# The projector needs no record the moment it is written: the broker answers its fetch
# once this much is waiting (or after ``batch_max_ms``), not at every transaction's
# commit, so a busy log costs a few fetches per second instead of dozens.
FETCH_MIN_BYTES = 64 * 1024


def caused_by_event(exc: BaseException) -> bool:
    """Whether a database error belongs to the event being written, not to the database."""
    if isinstance(exc, (psycopg.DataError, psycopg.IntegrityError)):
        return True  # also raised by psycopg itself, e.g. for NUL in text
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "")[:2] in EVENT_SQLSTATE_CLASSES


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
        self.retries = Counter("projector_retries",
                               "Batches retried after a database or Kafka error",
                               registry=registry)
        self.keys_destroyed = Counter(
            "projector_keys_destroyed", "Data keys of deleted conversations the projector "
            "destroyed (tombstones written, with the conversation's erasure)",
            registry=registry)


@dataclass
class Batch:
    """What applying a batch did."""

    positions: dict[TP, int] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    parked: list[tuple[Record, str]] = field(default_factory=list)
    # The conversations a SessionDeleted of the batch deleted, or a key of the batch is
    # of: their keys are destroyed if the conversation is deleted.
    deleted: set[uuid.UUID] = field(default_factory=set)
    destroyed: int = 0  # keys of deleted conversations destroyed


def load_positions(conn: psycopg.Connection) -> dict[TP, int]:
    rows = conn.execute("SELECT topic, partition, next_offset FROM projector_positions")
    return {(t, p): o for t, p, o in rows}


Park = Callable[[list[tuple[Record, str]]], Awaitable[None]]
# Destroys these keys of these deleted conversations (conversation, tenant, key ids).
Destroy = Callable[[list[tuple[uuid.UUID, str, list[str]]]], Awaitable[None]]
# Holds the data keys of these records of ``chat.keys`` (``Keyring.hold_read``).
HoldKeys = Callable[[list[Record]], Awaitable[object]]


async def apply_batch(
    conn: psycopg.AsyncConnection,  # autocommit: each step is a transaction of its own
    records: list[Record],
    codec: Codec,
    park: Park | None = None,
    keep: Callable[[Event], bool] = lambda _e: True,
    destroy: Destroy | None = None,
    hold_keys: HoldKeys | None = None,
) -> Batch:
    """Apply ``records`` and their positions in one transaction, their content opened
    with ``codec``.

    Records that do not decode, events the projection cannot turn into writes, and
    events whose rows Postgres refuses for their content (``caused_by_event``) are
    skipped and handed to ``park`` with the reason before the transaction commits, so
    they are dead-lettered before the positions that skip them are stored. Events for
    which ``keep`` is false are skipped silently (their positions advance). The keys of
    deleted conversations (``projections.keys``) are handed to ``destroy`` before it
    commits too, so they are destroyed before the positions past the deletion are
    stored, and their rows dropped. The batch's records of ``chat.keys`` are handed to
    ``hold_keys`` before any event is opened, so that the content sealed with the keys
    they hold opens with no look-up of its own. Any other error propagates, and nothing
    of the batch is stored.
    """
    batch = Batch()
    if hold_keys is not None and (keys := [r for r in records if r.position.topic == KEYS]):
        await hold_keys(keys)
    decoded: list[tuple[Record, Event]] = []
    writes: list[tuple[Record, Event | None, list[Write]]] = []  # None: a key record
    for record in records:
        pos = record.position
        batch.positions[(pos.topic, pos.partition)] = pos.offset + 1
        if pos.topic == KEYS:
            try:
                writes.append((record, None, key_writes(record)))
            except ValueError as exc:
                batch.parked.append((record, f"not a data key's record: {exc}"))
                continue
            parsed = parse_record_key(record.key)
            if parsed is not None:
                batch.deleted.add(parsed[0])
            continue
        try:
            event = await codec.decode_async(record.value)
        except DecodeError as exc:
            batch.parked.append((record, str(exc)))
            continue
        if keep(event):
            decoded.append((record, event))
            if isinstance(event, SessionDeleted):
                batch.deleted.add(event.conversation_id)
    async with conn.transaction():
        ledger = await _ledger(conn, [e for _, e in decoded if isinstance(e, PromptSubmitted)])
    for record, event in decoded:
        offset = record.position.offset
        try:
            verdict = ledger.decide(event.conversation_id, event.request_id, event.history_end,
                                    offset).verdict if isinstance(event, PromptSubmitted) \
                else Verdict.ACCEPTED
            writes.append((record, event, project(event, offset, verdict)))
        except Exception as exc:  # the projection is pure: the event itself is at fault
            batch.parked.append((record, f"cannot be projected: {exc!r}"))

    async def finish() -> None:
        await store_positions(conn, batch.positions)
        if park is not None and batch.parked:
            await park(batch.parked)
        if batch.deleted:
            batch.destroyed = await _destroy_doomed(conn, batch.deleted, destroy)

    try:
        async with conn.transaction(), conn.pipeline():
            for _, subject, subject_writes in writes:
                await _write(conn, subject, subject_writes, batch)
            await finish()
        return batch
    except psycopg.Error as exc:
        if not caused_by_event(exc) or conn.broken:
            raise
    # One event's content made Postgres refuse the batch: redo it one event at a time,
    # each in a savepoint, and park the events that are refused for what they hold.
    batch.applied.clear()
    parked_before = len(batch.parked)
    async with conn.transaction():
        for record, subject, subject_writes in writes:
            try:
                async with conn.transaction():
                    await _write(conn, subject, subject_writes, batch)
            except psycopg.Error as exc:
                if not caused_by_event(exc):
                    raise
                batch.parked.append((record, f"rejected by the store: {exc}"))
        await finish()
    log.warning("the store refused %d events of a batch of %d",
                len(batch.parked) - parked_before, len(records))
    return batch


async def _destroy_doomed(conn: psycopg.AsyncConnection, touched: set[uuid.UUID],
                          destroy: Destroy | None) -> int:
    """Destroy the keys of the deleted conversations among ``touched`` (with ``destroy``:
    a replay only drops their rows), and drop their rows: how many."""
    rows = await (await conn.execute(DOOMED, (list(touched),))).fetchall()
    if not rows:
        return 0
    doomed: dict[uuid.UUID, tuple[str, list[str]]] = {}
    for key_id, conversation, tenant in rows:
        doomed.setdefault(conversation, (tenant, []))[1].append(key_id)
    if destroy is not None:
        await destroy([(c, tenant, keys) for c, (tenant, keys) in doomed.items()])
    await conn.execute(DROP, ([key_id for key_id, _, _ in rows],))
    return len(rows)


async def _ledger(conn: psycopg.AsyncConnection, prompts: list[PromptSubmitted]) -> TurnLedger:
    """A ledger that knows the stored turns these prompts' verdicts depend on: those of
    their conversations accepted at or after the earliest ``history_end`` among them."""
    ledger = TurnLedger()
    judged = [p for p in prompts if p.history_end is not None]
    if judged:
        rows = await (await conn.execute(
            "SELECT conversation_id, request_id, prompt_offset FROM generations"
            " WHERE conversation_id = ANY(%s) AND prompt_offset >= %s",
            (list({p.conversation_id for p in judged}),
             min(p.history_end for p in judged if p.history_end is not None)))).fetchall()
        for conversation_id, request_id, offset in rows:
            ledger.know(conversation_id, offset, request_id)
    return ledger


async def _write(conn: psycopg.AsyncConnection, event: Event | None, writes: list[Write],
                 batch: Batch) -> None:
    for write in writes:
        await conn.execute(write.sql, write.params)
    kind = event.type if event is not None else "DataKey"
    batch.applied[kind] = batch.applied.get(kind, 0) + 1


async def store_positions(conn: psycopg.AsyncConnection, positions: dict[TP, int]) -> None:
    async with conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO projector_positions (topic, partition, next_offset)"
            " VALUES (%s, %s, %s) ON CONFLICT (topic, partition)"
            # Positions only move forward, even if a projector that lost its partitions
            # still applies an old batch (the writes themselves are idempotent).
            " DO UPDATE SET next_offset ="
            " GREATEST(projector_positions.next_offset, EXCLUDED.next_offset)",
            [(t, p, o) for (t, p), o in positions.items()],
        )


class Projector:
    def __init__(
        self,
        settings: ProjectorSettings,
        bootstrap: str,
        database_url: str,
        registry: CollectorRegistry,
        topics: tuple[str, ...] = STORE_TOPICS,
        group: str | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self.settings = settings
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.metrics = ProjectorMetrics(registry)
        self.topics = topics
        self.group = group or settings.group
        self.keyring = keyring  # the deleted conversations' keys are destroyed with it
        # The store holds content in the clear, opened with the ring's keys.
        self.codec = keyring.codec if keyring is not None else CLEAR
        self._quiet = QuietLog(log)
        self._positions: dict[TP, int] = {}  # what is stored, as far as this process knows
        # Stored positions not yet mirrored into Kafka for lag tools: those applied or
        # skipped since the last report, and those of partitions just assigned (a
        # projector that starts at the log's end moves none, and lag tools saw the group
        # where an earlier process had left it).
        self._unmirrored: dict[TP, int] = {}
        self._conn: psycopg.AsyncConnection | None = None
        self._producer = EventProducer(self.bootstrap)  # parks what cannot be applied
        self._last_report = self._last_skip = 0.0

    def _on_assign(self, partitions: list[TP], closing: Callable[[], bool] = lambda: False
                   ) -> dict[TP, int] | None:
        """Start every assigned partition at the position stored with the rows (waiting,
        with backoff, for the database if it is away). None, nothing started, once
        ``closing()``: the projector stops, and its stop must not wait for the database."""
        backoff = Backoff(RETRY_MIN_S, RETRY_MAX_S)
        while True:
            try:
                with psycopg.connect(self.database_url, connect_timeout=10) as conn:
                    stored = load_positions(conn)
                break
            except psycopg.OperationalError as exc:
                if closing():
                    log.info("assignment dropped: the projector's consumer closes")
                    return None
                self._quiet.warning("cannot read the stored positions, retrying: %s", exc)
                time.sleep(backoff.next())
        start = {tp: stored.get(tp, BEGINNING) for tp in partitions}
        self._positions = {tp: o for tp, o in start.items() if o >= 0}
        self._unmirrored.update(self._positions)
        log.info("assigned %s", {f"{t}/{p}": o for (t, p), o in start.items()})
        return start

    async def run(self, stop: asyncio.Event) -> None:
        """Project until ``stop`` (``pipeline.projecting``). A batch the database does
        not take (other than for one event's content, see ``apply_batch``) is retried
        with backoff, reconnecting when the connection is gone, until it is taken: the
        store catches up by itself once the database is back."""
        window_s = self.settings.batch_max_ms / 1000
        consumer = GroupConsumer(self.bootstrap, self.group, "projector",
                                 **{"session.timeout.ms": self.settings.session_timeout_ms,
                                    "fetch.min.bytes": FETCH_MIN_BYTES,
                                    "fetch.wait.max.ms": max(int(window_s * 1000), 1)})
        consumer.subscribe(list(self.topics), on_assign=lambda partitions: self._on_assign(
            partitions, lambda: consumer.closing))

        def retrying(exc: BaseException, records: int, delay: float) -> None:
            self.metrics.retries.inc()
            self._quiet.warning("could not apply a batch of %d records (retrying in %.1f s): "
                                "%s", records, delay, exc)

        try:
            await run_projection(
                consumer, self, Rounds(self.settings.batch_max_events, IDLE_WAIT_S, window_s,
                                       RETRY_MIN_S, RETRY_MAX_S),
                stop, (psycopg.Error, OSError, ProduceError, KeyringError), retrying)
        finally:
            if self._conn is not None:
                await self._conn.close()
            await consumer.close()
            self._producer.close()

    async def project_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        """Apply ``records``, and store the positions moved past records never delivered,
        on a connection made again if the last one broke."""
        try:
            if self._conn is None:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.database_url, connect_timeout=10, autocommit=True)
            conn = self._conn
            if records:
                positions = await self._apply(conn, self._producer, records)
                self._positions.update(positions)
                self._unmirrored.update(positions)
            if time.monotonic() - self._last_skip > SKIPPED_INTERVAL_S:
                # Also while records keep coming: a turn streaming for seconds would hold
                # back ``GET /v1/sessions`` that long otherwise.
                self._unmirrored.update(await self._store_skipped(conn, consumer))
                self._last_skip = time.monotonic()
        except (psycopg.Error, OSError, ProduceError, KeyringError):
            if self._conn is not None and (self._conn.broken or self._conn.closed):
                await self._conn.close()
                self._conn = None
            raise

    async def after_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        """Once a second: the positions mirrored into Kafka for lag tools, and the lag."""
        if time.monotonic() - self._last_report < REPORT_INTERVAL_S:
            return
        newest = records[-1].timestamp_ms / 1000 if records else time.time()
        self._last_report = time.monotonic()
        unmirrored, self._unmirrored = self._unmirrored, {}
        await self._commit_for_lag_tools(consumer, unmirrored)
        behind = sum((await consumer.lag()).values())
        self.metrics.lag_events.set(behind)
        self.metrics.lag_seconds.set(max(time.time() - newest, 0) if behind else 0)

    async def _store_skipped(self, conn: psycopg.AsyncConnection,
                             consumer: GroupConsumer) -> dict[TP, int]:
        """Store the positions the consumer moved past records it never delivers
        (transaction markers, aborted records), so the stored positions reach the end of
        the log (``GET /v1/sessions`` waits for that); return them (every record polled
        has been applied when this is called)."""
        moved = {tp: offset for tp, offset in (await consumer.positions()).items()
                 if offset > self._positions.get(tp, -1)}
        if moved:
            async with conn.transaction():
                await store_positions(conn, moved)
            self._positions.update(moved)
        return moved

    async def _destroy_keys(self, doomed: list[tuple[uuid.UUID, str, list[str]]]) -> None:
        keyring = self.keyring
        assert keyring is not None

        self.metrics.keys_destroyed.inc(await asyncio.to_thread(keyring.destroy, doomed))

    async def _commit_for_lag_tools(
        self, consumer: GroupConsumer, positions: dict[TP, int]
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

        ring = self.keyring
        batch = await apply_batch(
            conn, records, self.codec, park,
            destroy=self._destroy_keys if ring is not None else None,
            hold_keys=(lambda keys: asyncio.to_thread(ring.hold_read, keys))
            if ring is not None else None)
        self.metrics.dead_letters.inc(len(batch.parked))
        for kind, n in batch.applied.items():
            self.metrics.events.labels(kind).inc(n)
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return batch.positions
