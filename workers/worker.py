"""The worker: consumes ``chat.prompts`` and ``chat.control`` in group ``workers`` and runs
many prompts at once on one engine.

* Every prompt becomes its own task on the engine, so the engine batches them
  continuously. While ``max_num_seqs`` turns run (or wait for a slot here), fetching
  prompts pauses; control events are fetched regardless, so a cancel, a client leaving
  or a session deleted reaches its turn however full the engine is, and a turn
  cancelled or abandoned while it waited never starts (``workers.control``).
* A prompt is judged before it runs (``schemas.conversation.TurnLedger``): a void prompt
  (a racing turn of the same session came first) and a duplicate of a turn already
  accepted are never run.
* A turn's input is its session's history, kept from the turns run here or rebuilt from
  the durable record (``workers.history``), then its prompt's new messages.
* Everything the worker writes goes through one ``TransactionalProducer``: the turns'
  text to ``chat.live``, one record per partition per engine step, with their starts
  and ends to ``chat.generations`` (``workers.output``). Each transaction commits the
  prompts' offsets too (the low watermark of unfinished turns, so a crash re-delivers
  every unfinished prompt, and how much waits: ``workers.offsets``), and the broker
  refuses it once the worker has left the group. A worker that was paused or cut off
  while its partitions moved on writes nothing a reader sees.
* Takeover: a worker handed a partition first reads what earlier owners left in the
  log (``workers.recovery``), and the recent control events. Turns that ended are not
  run again; unfinished ones continue after their emitted tokens, under the next
  ``attempt``, with ``seq`` carrying on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import TP, DecodeError, conversation_key, decode, encode
from pipeline.deadletter import dead_letter_headers
from pipeline.kafka import (
    QUICK_ASSIGN,
    AsyncConsumer,
    Fenced,
    KafkaException,
    Record,
    TransactionalProducer,
    first_records,
    group_committed,
    high_watermarks,
    read_spans,
    scan_partitions,
    topic_limits,
)
from pipeline.logs import turn_fields
from pipeline.retry import Backoff, QuietLog
from pipeline.roster import Heartbeat
from pipeline.topics import (
    CONTROL,
    DEADLETTER,
    GENERATIONS,
    LIVE,
    PROMPTS,
    WORKERS_GROUP,
    worker_client_id,
    workers_group,
)
from pipeline.tracing import TRACER, Context, Span, carrier_of, from_record, ms_to_ns
from schemas import (
    Event,
    EventIds,
    FinishReason,
    GenerationCancelled,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SessionDeleted,
    Usage,
)
from schemas.conversation import TurnLedger, Verdict
from schemas.history import History, turn_messages
from workers.coalescer import Coalescer
from workers.control import ControlBook
from workers.engine import Engine, EngineDead, EngineRejected, EngineRequest, warm_up
from workers.fairness import FairQueue
from workers.history import Histories, HistoryMetrics, HistoryUnavailable, Position3
from workers.offsets import OffsetTracker
from workers.output import Output
from workers.plan import Action, Progress, plan_start, stop_at
from workers.recovery import Found, LiveFolder, LogFolder

log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Turns that ended here, remembered so a re-submitted prompt (an idempotent retry
# racing its original) is not run twice.
ENDED_MEMORY = 100_000
POLL_RECORDS = 200
# How often offsets that moved without anything to write (skipped prompts, turns whose
# end was in the last transaction) are committed on their own.
COMMIT_INTERVAL_S = 0.2
# A prompt partition with records waiting that has not moved for this long while
# fetching gets its fetch restarted (``_unstall``).
STALL_S = 10.0
# The consumer's long poll. Short polls cost the broker about 0.2 ms of CPU each even
# when they bring nothing (measured: 3 consumers polling every 10 ms kept 5% of a core
# busy), and a worker's prompts and control events arrive at once however long it is:
# only a partition resumed or assigned while a poll is out waits for that poll to end.
FETCH_WAIT_MS = 100
# Prompts a full worker keeps taken and waiting beyond ``max_num_seqs``, per 8 slots:
# a slot that frees is filled from them at once, so the prompts fetched after the
# resume (up to ``FETCH_WAIT_MS`` later) only refill them.
PREFETCH_PER_8_SLOTS = 1
# Worker and gateway clocks may differ: a takeover scan starts this long before the oldest
# unfinished prompt's time.
CLOCK_SKEW_MS = 60_000
# A partition's ledger keeps this many prompts back; a prompt whose history was read
# further back than that has the ledger read the log again.
LEDGER_SPAN = 50_000


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker: Worker) -> None:
        engine = worker.engine
        model = engine.model_name
        Gauge("worker_running_sequences", "Generations the engine is running",
              registry=registry).set_function(engine.running)
        Gauge("worker_waiting_sequences", "Prompts taken but not yet running in the engine",
              registry=registry).set_function(
                  lambda: max(len(worker.in_flight) - engine.running(), 0) + len(worker.waiting))
        Gauge("worker_batch_utilisation", "Running sequences / max_num_seqs",
              registry=registry).set_function(lambda: engine.running() / engine.max_num_seqs)
        Gauge("worker_kv_cache_usage", "KV-cache usage as the engine reports it (0-1)",
              registry=registry).set_function(lambda: engine.kv_cache_usage() or 0.0)
        Gauge("worker_transactions", "Transactions committed", registry=registry
              ).set_function(lambda: worker.writer.transactions if worker.writer else 0)
        Gauge("worker_model_info", "The model this worker serves", ["model"],
              registry=registry).labels(model).set(1)
        self.in_flight_peak = Gauge("worker_in_flight_peak",
                                    "Most generations ever in flight at once",
                                    registry=registry)
        self.lag = Gauge("worker_prompt_lag", "Prompts behind the end of the assigned partitions",
                         registry=registry)
        self.assigned = Gauge("worker_assigned_partitions", "Prompt partitions this worker owns",
                              registry=registry)
        self.tokens = Counter("worker_generated_tokens", "Tokens generated", registry=registry)
        self.generations = Counter("worker_generations", "Generations ended, by outcome",
                                   ["outcome"], registry=registry)
        self.resumed = Counter("worker_resumed_generations",
                               "Turns continued from an earlier attempt", registry=registry)
        self.ttft = Histogram("worker_ttft_seconds", "Prompt taken to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("worker_inter_token_seconds", "Time between tokens of a sequence",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.dead_letters = Counter("worker_dead_letters", "Records sent to the dead-letter topic",
                                    registry=registry)
        self.skipped = Counter("worker_skipped_prompts",
                               "Prompts not run: void (a racing turn came first), duplicate, "
                               "or another model's (other_model)",
                               ["verdict"], registry=registry)
        self.unstarted = Counter("worker_unstarted_turns",
                                 "Turns ended before they started (cancelled, abandoned, "
                                 "session deleted)", registry=registry)
        self.fenced = Counter("worker_fenced",
                              "Transactions refused because this worker left its group",
                              registry=registry)
        self.histories = HistoryMetrics(
            kept=Counter("worker_histories_kept", "Turns whose history this worker kept",
                         registry=registry),
            rebuilt=Counter("worker_histories_rebuilt",
                            "Turns whose history was rebuilt from the log", registry=registry),
            reads=Counter("worker_history_reads", "Records read to rebuild histories",
                          registry=registry),
            mismatches=Counter("worker_history_mismatches",
                               "Histories unlike what their prompt said (logged)",
                               registry=registry))
        Gauge("worker_history_cache_chars", "Characters of history kept",
              registry=registry).set_function(lambda: worker.histories.chars)
        Gauge("worker_live_records", "chat.live records written", registry=registry
              ).set_function(lambda: worker.output.records if worker.output else 0)


@dataclass
class InFlight:
    tp: TP
    task: asyncio.Task[None]
    prompt: PromptSubmitted
    grace: asyncio.Task[None] | None = None
    cancelled: bool = False
    history: History | None = None  # once read: the session before this turn


@dataclass
class Waiting:
    prompt: PromptSubmitted
    tp: TP
    offset: int
    trace: Traced | None = None


@dataclass(frozen=True)
class Traced:
    """A prompt's trace context (its record's headers) and when the log appended it."""

    parent: Context
    appended_ms: int


@dataclass
class _Ledger:
    """A partition's prompt verdicts, complete for offsets from ``known_from`` on."""

    known_from: int
    ledger: TurnLedger = field(default_factory=TurnLedger)


class Worker:
    def __init__(
        self, engine: Engine, bootstrap: str, registry: CollectorRegistry, name: str = "",
        *, session_timeout_ms: int = 10_000, recovery_window_s: float = 300.0,
        coalesce_ms: float = 10.0, transaction_timeout_ms: int = 10_000,
        transactional_id: str = "", transaction_interval_ms: float = 0.0,
        max_record_bytes: int = 8 * 2**20, history_cache_chars: int = 64 * 2**20,
        compression: str = "zstd", read_ahead: int = 4096,
        read_ahead_chars: int = 256 * 2**20,
        tenant_weights: dict[str, float] | None = None,
        max_running_per_tenant: int | None = None, fair: bool = True,
    ) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.session_timeout_ms = session_timeout_ms
        self.recovery_window_s = recovery_window_s
        self.coalesce_s = coalesce_ms / 1000
        self.transaction_timeout_ms = transaction_timeout_ms
        self.transaction_interval_ms = transaction_interval_ms
        self.max_record_bytes = max_record_bytes
        self.compression = compression
        # Unique per process unless configured: a stable id (one per worker slot) lets a
        # restarted worker fence its predecessor's open transaction at once.
        self._own_transactional_id = not transactional_id
        self.transactional_id = (transactional_id
                                 or f"chat-worker-{self.name}-{uuid.uuid4().hex[:8]}")
        self.tracker = OffsetTracker()
        self.in_flight: dict[str, InFlight] = {}
        # Prompts read and waiting for a slot, started by a fair share between tenants.
        self.read_ahead = read_ahead
        self.read_ahead_chars = read_ahead_chars
        self.waiting: FairQueue[Waiting] = FairQueue(
            lambda w: w.prompt.tenant, tenant_weights, max_running_per_tenant,
            size_of=_waiting_chars, fair=fair)
        self.peak_in_flight = 0
        self.recovered = Found()
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.book = ControlBook()
        self.ledgers: dict[int, _Ledger] = {}
        self.writer: TransactionalProducer | None = None
        self.output: Output | None = None
        self.metrics = WorkerMetrics(registry, self)
        self.histories = Histories(self._read_at, self.metrics.histories, history_cache_chars)
        self._history_reader: AsyncConsumer | None = None
        self._gathering = False  # a call to ``_gather`` is scheduled
        self._assignments = 0  # bumped by each assignment, so the loop re-applies pausing
        self._fenced = asyncio.Event()
        self._rejoin = False  # a refusal that no rebalance answers: leave and rejoin
        self._quiet = QuietLog(log)
        self._progress: dict[TP, tuple[int | None, float]] = {}  # position, since when
        self._fatal: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._consumer: AsyncConsumer | None = None

    @property
    def capacity(self) -> int:
        """Prompts taken at most: those the engine runs, and ``read_ahead`` waiting for a
        slot (at least a few per 8 slots): the fair share chooses among those read, so
        it reads as far ahead as the backlog a gateway admits."""
        slots = self.engine.max_num_seqs
        return slots + max(self.read_ahead, slots * PREFETCH_PER_8_SLOTS // 8)

    # -- rebalances (these run on the consumer's thread, inside a poll) -------
    def _on_assign(self, assigned: list[TP]) -> dict[TP, int]:
        """Take partitions over: retried (with backoff) while Kafka does not answer, as a
        broker restarting makes it; the worker never exits for that."""
        backoff = Backoff(0.5, 10.0)
        while True:
            try:
                return self._take_over(assigned)
            except (KafkaException, TimeoutError) as exc:
                delay = backoff.next()
                self._quiet.warning("could not take partitions over (retrying in %.1f s): %s",
                                    delay, exc)
                time.sleep(delay)

    def _take_over(self, assigned: list[TP]) -> dict[TP, int]:
        assert self._consumer is not None
        prompts = [p for t, p in assigned if t == PROMPTS]
        controls = [p for t, p in assigned if t == CONTROL]
        # Prompts are read on from the committed offsets: the ledger and the offsets of
        # each transaction start there, and the scans below start at the oldest of them.
        # A model's group the first time: where the single group of earlier versions
        # stopped, so nothing that group ran runs again (else the partition's start).
        committed = self._consumer.committed_sync(
            [(PROMPTS, p) for p in prompts],
            fallback=lambda missing: group_committed(self.bootstrap, WORKERS_GROUP, missing))
        for tp, offset in committed.items():
            self.tracker.start(tp, offset)
        since = self._scan_starts(committed)
        # What earlier owners wrote (committed, or resolved if still open: read_spans).
        # Open transactions of an earlier owner end within the transaction timeout.
        wait_s = max(60.0, 3 * self.transaction_timeout_ms / 1000)
        # Folded as they are read: a busy window holds millions of records. The ends,
        # and the deltas of turns written before the live stream, are in the durable
        # record; the deltas of the others, in the live stream.
        durable = LogFolder()
        for record in reported(scan_partitions(self.bootstrap, GENERATIONS, list(since),
                                               since, wait_s),
                               min(since.values(), default=0), f"reading {GENERATIONS}"):
            durable.add(record.value)
        live = LiveFolder({p: committed[(PROMPTS, p)] for p in since})
        for record in reported(scan_partitions(self.bootstrap, LIVE, list(since), since,
                                               wait_s),
                               min(since.values(), default=0), f"reading {LIVE}"):
            live.add(record.position.partition, record.value)
        found = Found({rid: rec for rid, rec in durable.result().items()
                       if rid not in self.in_flight}, live.result())
        self.recovered = found  # an assignment is whole: earlier findings are stale
        # The recent control events, so a turn cancelled or abandoned while its prompt
        # waited is known before the prompt comes up; control is read on from there.
        control_ends = high_watermarks(self.bootstrap, CONTROL, controls)
        for record in scan_partitions(self.bootstrap, CONTROL, [p for p in controls if p in since],
                                      since, wait_s, ends=control_ends):
            event = _decoded(record)
            if event is not None:
                self.book.apply(event, logged_at(record))
        self.ledgers = {p: _Ledger(known_from=committed[(PROMPTS, p)]) for p in prompts}
        assert self.writer is not None  # the new generation, for every transaction from now
        self.writer.set_group(self._consumer.group_metadata_sync())
        self._assignments += 1
        self.metrics.assigned.set(len(prompts))
        log.info("assigned prompts %s; recent: %s", prompts, found.describe())
        return {**{(PROMPTS, p): committed[(PROMPTS, p)] for p in prompts},
                **{(CONTROL, p): control_ends[p] for p in controls}}

    def _scan_starts(self, committed: dict[TP, int]) -> dict[int, int]:
        """Per prompt partition with unfinished prompts, the time to scan from: the oldest
        uncommitted prompt's (what its turn and later ones wrote came after it), less
        clock skew, however long ago: a turn whose history was read in part would run
        again from its start, under seqs its readers have seen (and one whose clients
        left would run on). The recovery window applies only to a partition with no
        readable prompt past its committed offset. Partitions whose prompts are all
        committed need no scan."""
        ends = high_watermarks(self.bootstrap, PROMPTS, [p for _, p in committed])
        spans = {p: (o, ends[p]) for (_, p), o in committed.items() if o < ends[p]}
        oldest = {p: r.timestamp_ms
                  for p, r in first_records(self.bootstrap, PROMPTS, spans).items()}
        now_ms = int(time.time() * 1000)
        window_ms = int(self.recovery_window_s * 1000)
        starts = {p: oldest.get(p, now_ms - window_ms) - CLOCK_SKEW_MS for p in spans}
        back_ms = now_ms - min(starts.values(), default=now_ms)
        if back_ms > window_ms + CLOCK_SKEW_MS:
            log.warning("taking over: reading %s back %.0f s, to the oldest unfinished "
                        "prompt (past the %.0f s recovery window)", GENERATIONS,
                        back_ms / 1000, self.recovery_window_s)
        return starts

    def _on_revoke(self, revoked: list[TP]) -> None:
        assert self._loop is not None and self.writer is not None
        partitions = [p for t, p in revoked if t == PROMPTS]
        abandon = asyncio.run_coroutine_threadsafe(self._abandon(partitions), self._loop)
        abandon.result(timeout=30)
        # Nothing is committed here: the rebalance waits for this callback, and a
        # transaction's group check waits for the rebalance. Records not yet in a
        # transaction are dropped; one in flight either passed its check before the
        # generation ended (its records were in the log before that, so the next owner's
        # scan waits for it) or is refused. The next owner regenerates what was dropped.
        self.writer.new_epoch()
        self.tracker.forget([(PROMPTS, p) for p in partitions])
        for p in partitions:
            self.ledgers.pop(p, None)
        self.metrics.assigned.set(len(self.ledgers))

    async def _abandon(self, partitions: list[int]) -> None:
        """Stop this worker's turns in ``partitions``; their next owner resumes them."""
        # Waiting prompts first: a turn that ends meanwhile starts the next waiting one.
        self.waiting.remove(lambda w: w.tp[1] in partitions)
        flights = [f for f in self.in_flight.values() if f.tp[1] in partitions]
        for flight in flights:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in flights), return_exceptions=True)
        if self.output is not None:  # what they wrote but did not yet queue
            self.output.drop(partitions)
        if flights:
            log.info("handed %d unfinished turns to the next owner", len(flights))

    def _on_fenced(self, answered: bool) -> None:
        """The broker refused a transaction (called on the writer's thread); ``answered``:
        an assignment under way, or made since, starts the dropped turns again."""
        self.metrics.fenced.inc()
        self._rejoin = self._rejoin or not answered
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fenced.set)

    # -- the loop ---------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        consumer = self._consumer = AsyncConsumer(
            self.bootstrap, workers_group(self.engine.model_name),
            **{"session.timeout.ms": self.session_timeout_ms,
               "client.id": worker_client_id(self.engine.model_name),
               # A worker owns the same partition number of both topics.
               "partition.assignment.strategy": "range",
               "fetch.wait.max.ms": FETCH_WAIT_MS})
        limits = await asyncio.to_thread(topic_limits, self.bootstrap, [GENERATIONS, LIVE],
                                         self.max_record_bytes)
        self.writer = TransactionalProducer(
            self.bootstrap, self.transactional_id, self.tracker.positions,
            on_committed=self.tracker.mark_committed, on_fenced=self._on_fenced,
            timeout_ms=self.transaction_timeout_ms, own_id=self._own_transactional_id,
            interval_ms=self.transaction_interval_ms, gathers=True,
            max_record_bytes=max(limits.values()), limits=limits,
            offset_metadata=self.tracker.describe, compression=self.compression)
        self.output = Output(self.writer, self.name)
        self._history_reader = AsyncConsumer(self.bootstrap, f"worker-history-{self.name}",
                                             **QUICK_ASSIGN)
        await asyncio.to_thread(self.writer.start)
        # Ready means a turn starts without waiting for the engine's first batches: the
        # worker joins its group (and says it is alive) only once it has run its own.
        began = time.monotonic()
        try:
            await warm_up(self.engine)
        except EngineRejected as exc:  # a model that takes none of them: it serves anyway
            log.warning("the engine refused its warm-up turns: %s", exc)
        log.info("engine warmed up in %.1f s; taking prompts", time.monotonic() - began)
        heartbeat = Heartbeat(self.bootstrap, self.transactional_id, self.engine.model_name,
                              self.engine.max_model_len, self.engine.max_token_bytes,
                              load=self.waiting.load)
        consumer.subscribe([PROMPTS, CONTROL], on_assign=self._on_assign,
                           on_revoke=self._on_revoke)
        paused: bool | None = None  # as applied to the assignment of version `applied`
        applied = -1
        last_lag = last_commit = 0.0
        try:
            while not stop.is_set() and self._fatal is None:
                if self._fenced.is_set():
                    # The group refused a transaction: this worker may have lost its
                    # partitions, so it drops its turns, and only a takeover's scan
                    # starts them again. An assignment under way or made since brings
                    # one; a refusal of the current one need not (a coordinator back
                    # from a pause refused a generation the group still had): then
                    # rejoin, so an assignment comes to this worker or to another.
                    # (Rejoining on every refusal would refuse the other workers'
                    # transactions with a rebalance, and they would rejoin in turn.)
                    self._fenced.clear()
                    rejoin, self._rejoin = self._rejoin, False
                    await self._abandon(list(self.ledgers))
                    self.output.drop()
                    if rejoin:
                        await consumer.rejoin()
                full = (len(self.in_flight) + len(self.waiting) >= self.capacity
                        or self.waiting.size >= self.read_ahead_chars)
                # A new assignment may hold partitions paused before a rebalance, or
                # none paused while the engine is full: set the state anew each time.
                if full != paused or applied != self._assignments:
                    applied, paused = self._assignments, full
                    await (consumer.pause if full else consumer.resume)(PROMPTS)
                # Paused, only control events come: poll briefly, to see freed slots soon.
                for record in await consumer.poll_batch(POLL_RECORDS, 0.02 if full else 0.05):
                    await self._take(record)
                self._start_waiting()
                heartbeat.beat()
                if self.writer.failed is not None:
                    self._fatal = self.writer.failed
                if time.monotonic() - last_commit > COMMIT_INTERVAL_S:
                    # Every record polled so far is taken: the consumer's position may pass
                    # transaction markers, so the group's lag reaches 0 when all is done.
                    self.tracker.advance({tp: o for tp, o in (await consumer.positions()).items()
                                          if tp[0] == PROMPTS})
                    if self.tracker.committable() or self.tracker.stale_descriptions():
                        # offsets moved, or the work waiting changed, with nothing to write
                        self.writer.commit_offsets()
                    last_commit = time.monotonic()
                if time.monotonic() - last_lag > 1.0:
                    lag = {tp: n for tp, n in (await consumer.lag()).items()
                           if tp[0] == PROMPTS}
                    self.metrics.lag.set(sum(lag.values()))
                    await self._unstall(consumer, lag, bool(paused))
                    last_lag = time.monotonic()
            self._stopping = True
            await self._drain()
        finally:
            await asyncio.to_thread(heartbeat.leave)
            await asyncio.to_thread(self.writer.close)
            await consumer.close()
            await self._history_reader.close()
        if self._fatal is not None:
            raise self._fatal

    async def _unstall(self, consumer: AsyncConsumer, lag: dict[TP, int],
                       paused: bool) -> None:
        """Restart the fetch of a prompt partition that has records waiting but has not
        moved for ``STALL_S`` while fetching (a fetcher stuck after a leader change)."""
        now = time.monotonic()
        positions = await consumer.positions(list(lag))
        stalled = []
        for tp, behind in lag.items():
            position = positions.get(tp)
            last = self._progress.get(tp)
            if paused or behind == 0 or last is None or last[0] != position:
                self._progress[tp] = (position, now)
            elif now - last[1] > STALL_S:
                stalled.append(tp)
                self._progress[tp] = (position, now)
        if stalled:
            log.warning("prompt partitions %s have records waiting but did not move for "
                        "%.0f s: restarting their fetch", [p for _, p in stalled], STALL_S)
            await consumer.restart_fetch(stalled)

    async def _drain(self, grace_s: float = 30.0) -> None:
        tasks = [f.task for f in self.in_flight.values()]
        if tasks:
            log.info("waiting for %d generations to finish", len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()

    # -- records ------------------------------------------------------------------
    async def _take(self, record: Record) -> None:
        topic, partition, offset = record.position.topic, record.position.partition, \
            record.position.offset
        if topic == PROMPTS:
            self.tracker.taken((topic, partition), offset)
        try:
            event = decode(record.value)
        except DecodeError as exc:
            await self._dead_letter(record, str(exc))
            self._done((topic, partition), offset)
            return
        if not isinstance(event, PromptSubmitted):
            # Control events; also found in chat.prompts when written by gateways from
            # before chat.control existed.
            await self._control(event, logged_at(record))
            self._done((topic, partition), offset)
            return
        # Judged whatever its model: every group keeps the same ledger of the partition.
        verdict = await self._judge(event, partition, offset)
        if verdict is Verdict.ACCEPTED and event.model != self.engine.model_name:
            # Another model's turn: its own group runs it.
            self.metrics.skipped.labels("other_model").inc()
            self._done((topic, partition), offset)
            return
        if verdict is not Verdict.ACCEPTED:
            if verdict is not None:
                self.metrics.skipped.labels(verdict.value).inc()
                log.info("not running %s: its prompt at %s is %s", event.request_id,
                         record.position, verdict.value, extra=turn_fields(event))
            self._done((topic, partition), offset)
            return
        self.tracker.queued((topic, partition), offset)
        parent = from_record(record.headers)
        self.waiting.push(Waiting(event, (topic, partition), offset, None if parent is None
                                  else Traced(parent, record.timestamp_ms)))

    def _done(self, tp: TP, offset: int) -> None:
        if tp[0] == PROMPTS:
            self.tracker.done(tp, offset)

    async def _dead_letter(self, record: Record, reason: str) -> None:
        assert self.writer is not None
        log.warning("dead-lettering %s: %s", record.position, reason)
        self.metrics.dead_letters.inc()
        try:
            await self.writer.send_raw(DEADLETTER, record.key, record.value,
                                       dead_letter_headers(record, reason, WORKERS_GROUP),
                                       self.writer.epoch)
        except Fenced:
            pass  # the partition moved on: its next owner dead-letters the record

    async def _judge(self, prompt: PromptSubmitted, partition: int,
                     offset: int) -> Verdict | None:
        """The prompt's verdict (None: the partition is no longer this worker's)."""
        state = self.ledgers.get(partition)
        if state is None:
            return None
        end = prompt.history_end
        if end is not None and end < state.known_from:
            await self._extend(state, partition, end)
        if offset - state.known_from > 2 * LEDGER_SPAN:  # keep the ledger bounded
            state.known_from = offset - LEDGER_SPAN
            state.ledger.forget_before(state.known_from)
        return state.ledger.decide(prompt.conversation_id, prompt.request_id, end,
                                   offset).verdict

    async def _extend(self, state: _Ledger, partition: int, start: int) -> None:
        """Make the ledger know the prompts from ``start`` on: read what lies before its
        known part, back as far as those prompts' own verdicts need."""
        target = start
        while True:
            records = await self._read_prompts(partition, target, state.known_from)
            prompts = [(r.position.offset, e) for r in records
                       if isinstance(e := _decoded(r), PromptSubmitted)]
            needed = min((p.history_end for _, p in prompts
                          if p.history_end is not None and p.history_end < target), default=None)
            if needed is None:
                break
            target = needed
        for offset, prompt in prompts:
            state.ledger.decide(prompt.conversation_id, prompt.request_id, prompt.history_end,
                                offset)
        state.known_from = target

    async def _read_prompts(self, partition: int, start: int, end: int) -> list[Record]:
        """The prompts in ``[start, end)``; the verdicts wait for them, so retry until read."""
        backoff = Backoff()
        while True:
            try:
                return await asyncio.to_thread(read_spans, self.bootstrap, PROMPTS,
                                               {partition: (start, end)})
            except (KafkaException, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("could not read prompts %d-%d of partition %d (retrying in "
                            "%.1f s): %s", start, end, partition, delay, exc)
                await asyncio.sleep(delay)

    async def _control(self, event: Event, logged: datetime | None) -> None:
        self.book.apply(event, logged)
        if isinstance(event, SessionDeleted):
            for other in list(self.in_flight.values()):
                if other.prompt.conversation_id == event.conversation_id:
                    await self._cancel(other)
            return
        flight = self.in_flight.get(event.request_id)
        if flight is None:
            return  # remembered in the book for when its prompt comes up
        if isinstance(event, GenerationCancelled):
            await self._cancel(flight)
            return
        self._arm_grace(flight)

    def _arm_grace(self, flight: InFlight) -> None:
        """Stop the turn when its grace ends, unless a client follows it again."""
        deadline = stop_at(self.book, flight.prompt)
        if deadline is None:
            if flight.grace is not None:
                flight.grace.cancel()
                flight.grace = None
        elif flight.grace is None:
            left = (deadline - datetime.now(UTC)).total_seconds()
            flight.grace = asyncio.create_task(self._cancel(flight, after_s=max(left, 0.0)))

    def _start_waiting(self) -> None:
        if self._stopping:
            return  # left in the log for the partitions' next owner
        while len(self.in_flight) < self.engine.max_num_seqs:
            item = self.waiting.pop()
            if item is None:
                return  # nothing waits, or only tenants at their cap
            self.tracker.started(item.tp, item.offset)
            if not self._start(item.prompt, item.tp, item.offset, item.trace):
                self.waiting.ended(item.prompt.tenant)

    def _start(self, prompt: PromptSubmitted, tp: TP, offset: int,
               traced: Traced | None = None) -> bool:
        """Start a turn (False: it needs not run: it ran, or runs, already)."""
        assert self.writer is not None
        rid = prompt.request_id
        plan = plan_start(prompt, self.recovered.take(rid, tp[1], offset),
                          rid in self.ended or rid in self.in_flight, self.book,
                          datetime.now(UTC))
        epoch = self.writer.epoch
        if plan.action is Action.SKIP:  # never run twice
            self._done(tp, offset)
            return False
        if plan.action is Action.END:
            log.info("not starting %s: %s", rid, plan.reason, extra=turn_fields(prompt))
            self.metrics.unstarted.inc()
            task = asyncio.create_task(self._end_unstarted(prompt, tp, offset, plan.progress,
                                                           epoch))
        else:
            task = asyncio.create_task(self._generate(prompt, tp, offset, plan.progress, epoch,
                                                      traced))
        flight = self.in_flight[rid] = InFlight(tp, task, prompt)
        if plan.action is Action.RUN:
            self._arm_grace(flight)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        self.metrics.in_flight_peak.set(self.peak_in_flight)
        return True

    async def _cancel(self, flight: InFlight, after_s: float = 0.0) -> None:
        if after_s:
            await asyncio.sleep(after_s)
            log.info("no client came back for %s: stopping it", flight.prompt.request_id,
                     extra=turn_fields(flight.prompt))
        if not flight.cancelled:
            flight.cancelled = True
            await self.engine.abort(flight.prompt.request_id)

    # -- one turn ----------------------------------------------------------------
    async def _end_unstarted(self, prompt: PromptSubmitted, tp: TP, offset: int,
                             progress: Progress, epoch: int) -> None:
        """End a turn that must not start: cancelled, with what earlier attempts wrote."""
        final = GenerationFinished(
            **_ids(prompt), ref=offset, model=self.engine.model_name, attempt=progress.attempt,
            reply_seq=prompt.reply_seq, finish_reason="abort", text="".join(progress.parts),
            deltas=len(progress.parts),
            usage=Usage(prompt_tokens=0, completion_tokens=len(progress.token_ids)),
            duration_ms=0.0)
        await self._finish(prompt, tp, offset, final, epoch)

    async def _generate(
        self, prompt: PromptSubmitted, tp: TP, offset: int, progress: Progress, epoch: int,
        traced: Traced | None = None,
    ) -> None:
        output = self.output
        assert output is not None
        partition = tp[1]
        ids = _ids(prompt)
        key = conversation_key(prompt.conversation_id)  # every durable event of the turn's
        attempt = progress.attempt
        started = last_token = time.monotonic()
        ttft: float | None = None
        coalescer = Coalescer(self.coalesce_s, emitted=len(progress.parts))

        def emit(delta: tuple[str, tuple[int, ...]] | None) -> None:
            """One delta to the live stream: seq stays gap-free."""
            if delta is None:
                return
            text, token_ids = delta
            output.delta(partition, offset, len(progress.parts), text, token_ids, epoch)
            self._gather_soon()
            progress.parts.append(text)
            progress.token_ids.extend(token_ids)

        prompt_tokens = 0
        finish_reason: FinishReason = "abort"
        final: GenerationFinished | GenerationFailed
        if attempt:
            self.metrics.resumed.inc()
            log.info("resuming %s at seq %d (attempt %d)", prompt.request_id,
                     len(progress.parts), attempt, extra=turn_fields(prompt))
        span = self._trace_start(prompt, offset, attempt, traced)
        try:
            if prompt.model != self.engine.model_name:
                raise EngineRejected("model_not_served", f"This worker serves "
                                     f"'{self.engine.model_name}', not '{prompt.model}'.")
            messages = await self.histories.input_for(prompt, partition)
            flight = self.in_flight.get(prompt.request_id)
            if flight is not None:
                flight.history = messages[:prompt.history_len]
            request = EngineRequest(prompt.request_id, messages, prompt.sampling,
                                    tuple(progress.token_ids),
                                    None if span is None else carrier_of(span))
            async for out in self.engine.generate(request):
                now = time.monotonic()
                if ttft is None:
                    ttft = now - started
                    prompt_tokens = out.prompt_tokens
                    self.waiting.served(prompt.tenant, prompt_tokens=prompt_tokens)
                    self.metrics.ttft.observe(ttft)
                    output.start(partition, offset, GenerationStarted(
                        **ids, ref=offset, model=self.engine.model_name, worker=self.name,
                        attempt=attempt, reply_seq=prompt.reply_seq,
                        prompt_tokens=prompt_tokens), key, epoch)
                    for earlier in progress.republish:  # only the durable record had them
                        output.delta(partition, offset, earlier.seq, earlier.text,
                                     earlier.token_ids, epoch)
                elif out.token_ids:
                    self.metrics.itl.observe((now - last_token) / len(out.token_ids))
                last_token = now
                self.metrics.tokens.inc(len(out.token_ids))
                self.waiting.served(prompt.tenant, output_tokens=len(out.token_ids))
                emit(coalescer.add(out.text, out.token_ids, now))
                if self.writer is not None and self.writer.backlogged:
                    await self.writer.room()  # Kafka takes tokens slower than they come
                if out.finish_reason in ("stop", "length"):
                    finish_reason = "stop" if out.finish_reason == "stop" else "length"
            emit(coalescer.drain())
            final = GenerationFinished(
                **ids, ref=offset, model=self.engine.model_name, attempt=attempt,
                reply_seq=prompt.reply_seq, finish_reason=finish_reason,
                text="".join(progress.parts), deltas=len(progress.parts),
                usage=Usage(prompt_tokens=prompt_tokens,
                            completion_tokens=len(progress.token_ids)),
                ttft_ms=None if ttft is None else ttft * 1000,
                duration_ms=(time.monotonic() - started) * 1000,
            )
        except asyncio.CancelledError:
            # Abandoned on revoke or shutdown: no terminal event, the offset stays
            # uncommitted, and the next owner resumes from what was emitted (tokens
            # still held back here are generated again by the next owner).
            self._forget(prompt.request_id)
            if span is not None:
                span.set_attribute("chat.abandoned", True)
                span.end()
            raise
        except (EngineRejected, HistoryUnavailable) as exc:
            final = GenerationFailed(**ids, ref=offset, attempt=attempt, code=exc.code,
                                     message=str(exc))
        except EngineDead as exc:
            final = GenerationFailed(**ids, ref=offset, attempt=attempt, code="engine_dead",
                                     message=str(exc))
            self._fatal = exc
        except Exception as exc:
            log.exception("generation %s failed", prompt.request_id, extra=turn_fields(prompt))
            final = GenerationFailed(**ids, ref=offset, attempt=attempt, code="internal_error",
                                     message=type(exc).__name__)
        if span is not None:
            span.set_attributes(_ended(final))
            span.end()
        await self._finish(prompt, tp, offset, final, epoch)

    def _trace_start(self, prompt: PromptSubmitted, offset: int, attempt: int,
                     traced: Traced | None) -> Span | None:
        """The turn's ``chat.queue`` span (from the log's append until now, when the
        engine takes it) and its ``chat.engine`` span, begun (``pipeline.tracing``)."""
        if traced is None:
            return None
        turn: dict[str, str | int] = {
            "chat.request_id": prompt.request_id, "chat.tenant": prompt.tenant,
            "chat.model": self.engine.model_name, "chat.attempt": attempt,
            "messaging.kafka.offset": offset, "chat.worker": self.name}
        TRACER.start_span("chat.queue", context=traced.parent, attributes=turn,
                          start_time=ms_to_ns(traced.appended_ms)).end()
        return TRACER.start_span("chat.engine", context=traced.parent, attributes=turn)

    def _gather_soon(self) -> None:
        """Once the turns this loop has ready have run, queue what they wrote (one live
        record per partition) and tell the writer it is all queued: an engine step's
        outputs wake its turns together, so the step's deltas share one record per
        partition and one transaction (see ``TransactionalProducer``)."""
        if not self._gathering:
            self._gathering = True
            asyncio.get_running_loop().call_soon(self._gather)

    def _gather(self) -> None:
        self._gathering = False
        if self.writer is not None and self.output is not None:
            self.output.flush(self.writer.epoch)
            self.writer.gathered()

    def _fits(self, final: GenerationFinished | GenerationFailed,
              ) -> GenerationFinished | GenerationFailed:
        """``final``, or, if the log would not take it (a reply larger than its topic's
        records), a failure that says so: the turn ends alone, never retried."""
        assert self.writer is not None
        limit = self.writer.limit(GENERATIONS)
        size = len(encode(final))
        if size <= limit - 1024:
            return final
        return GenerationFailed(
            conversation_id=final.conversation_id, request_id=final.request_id,
            tenant=final.tenant, ref=final.ref, attempt=final.attempt, code="reply_too_large",
            message=f"The reply ({size:,} bytes) is larger than the log takes ({limit:,} "
                    "bytes: PIPELINE_MAX_RECORD_BYTES).")

    async def _finish(self, prompt: PromptSubmitted, tp: TP, offset: int,
                      final: GenerationFinished | GenerationFailed, epoch: int) -> None:
        """Write the turn's end (its live entry and its durable event, in one transaction);
        once it is committed, so is (in the next transaction) the prompt's offset."""
        assert self.output is not None
        final = self._fits(final)
        try:
            written = self.output.end(tp[1], offset, final,
                                      conversation_key(prompt.conversation_id))
            self._gather_soon()
            await written
        except asyncio.CancelledError:
            self._forget(prompt.request_id)
            raise
        except Fenced:  # the partition moved on: its next owner finishes the turn
            self._forget(prompt.request_id)
            return
        except Exception as exc:  # the turn stays uncommitted and is redelivered
            log.error("could not record the end of %s: %s", prompt.request_id, exc,
                      extra=turn_fields(prompt))
            self._fatal = exc
            self._forget(prompt.request_id)
            return
        self._done(tp, offset)
        outcome = final.finish_reason if isinstance(final, GenerationFinished) else final.code
        self.metrics.generations.labels(outcome).inc()
        flight = self.in_flight.get(prompt.request_id)
        if flight is not None and flight.history is not None:
            self.histories.remember(prompt.conversation_id, offset,
                                    flight.history + turn_messages(prompt, final))
        self._forget(prompt.request_id, ended=True)

    async def _read_at(self, wanted: Sequence[Position3]) -> dict[Position3, Record | None]:
        """Records at exact positions, for histories: retried while Kafka is away (the
        turn waits for its history)."""
        reader = self._history_reader
        assert reader is not None
        backoff = Backoff()
        while True:
            try:
                return await reader.read_at(wanted)
            except (KafkaException, TimeoutError) as exc:
                delay = backoff.next()
                self._quiet.warning("could not read a history (retrying in %.1f s): %s",
                                    delay, exc)
                await asyncio.sleep(delay)

    def _forget(self, request_id: str, ended: bool = False) -> None:
        flight = self.in_flight.pop(request_id, None)
        if flight is not None:
            self.waiting.ended(flight.prompt.tenant)
            if flight.grace is not None:
                flight.grace.cancel()
        if ended:
            self.book.forget(request_id)
            self.ended[request_id] = None
            while len(self.ended) > ENDED_MEMORY:
                self.ended.popitem(last=False)
            self._start_waiting()  # the slot is free now, not at the loop's next turn


def _ended(final: GenerationFinished | GenerationFailed) -> dict[str, str | int | float]:
    if isinstance(final, GenerationFailed):
        return {"chat.failure": final.code}
    return {"chat.finish_reason": final.finish_reason,
            "gen_ai.usage.input_tokens": final.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": final.usage.completion_tokens,
            "chat.ttft_ms": final.ttft_ms or 0.0}


def _waiting_chars(item: Waiting) -> int:
    """What a waiting prompt holds in memory, in characters (what bounds the read-ahead)."""
    prompt = item.prompt
    return sum(len(m.content) for m in (*prompt.messages, *(prompt.history or ())))


def reported(records: Iterable[Record], since_ms: int, what: str,
             every_s: float = 10.0) -> Iterator[Record]:
    """``records`` (written from ``since_ms`` on), with a line logged every ``every_s``
    of a long read: how many so far, and how far through the time they span."""
    started = last = time.monotonic()
    span_ms = max(time.time() * 1000 - since_ms, 1.0)
    for count, record in enumerate(records, 1):
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            done = min(max((record.timestamp_ms - since_ms) / span_ms, 0.0), 1.0)
            log.info("taking over: %s: %d records in %.0f s, %.0f%% of the way to now",
                     what, count, now - started, 100 * done)
        yield record


def _ids(prompt: PromptSubmitted) -> EventIds:
    return EventIds(conversation_id=prompt.conversation_id, request_id=prompt.request_id,
                    tenant=prompt.tenant)


def _decoded(record: Record) -> Event | None:
    try:
        return decode(record.value)
    except DecodeError:
        return None


def logged_at(record: Record) -> datetime | None:
    """When the log appended ``record`` (its timestamp on a ``LogAppendTime`` topic)."""
    return datetime.fromtimestamp(record.timestamp_ms / 1000, UTC) \
        if record.timestamp_ms > 0 else None
