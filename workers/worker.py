"""The worker: consumes ``chat.prompts`` and ``chat.control`` in its model's group and
runs many turns at once on one engine. This file is the loop, what it does with each
record, and how a turn's end is written; the rest is beside it:

* Prompts are taken in a lane per partition (``workers.intake``): one that waits for
  its key or its ledger holds no other partition's, nor the loop.
* Each prompt is judged before it runs (``workers.ledger``): a void prompt (a racing
  turn of its session came first) or a duplicate never runs. Accepted ones wait for a
  slot, started by a fair share between tenants (``workers.fairness``). While the
  engine is full, fetching prompts pauses; control events are fetched regardless, so a
  cancel, a client leaving or a session deleted reaches its turn however full the engine
  is (``workers.flights``), and a turn cancelled while it waited never starts.
* A turn runs on the engine (``workers.turn``): its input is its session's history
  (``workers.history``), then its prompt's new messages.
* Everything the worker writes goes through one ``TransactionalProducer``: the turns'
  deltas to ``chat.live``, one record per partition per engine step, with their starts
  and ends to ``chat.generations`` (``workers.output``). Each transaction commits the
  prompts' offsets too (the low watermark of unfinished turns, and how much waits:
  ``workers.offsets``), and the broker refuses it once the worker has left the group.
* Takeover (``workers.takeover``, ``workers.recovery``): a worker handed a partition
  first reads what earlier owners left in the log, and the recent control events. Turns
  that ended are not run again; unfinished ones continue after their emitted deltas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from pipeline.codec import TP, Codec, DecodeError
from pipeline.kafka import (
    Fenced,
    GroupConsumer,
    LogReader,
    Record,
    StallWatch,
    TransactionalProducer,
    TransactionSettings,
    topic_limits,
)
from pipeline.kafka.clock import BrokerClock
from pipeline.logs import turn_fields
from pipeline.roster import Heartbeat
from pipeline.topics import CONTROL, GENERATIONS, LIVE, PROMPTS, workers_group
from pipeline.tracing import from_record
from schemas import GenerationFailed, GenerationFinished, PromptSubmitted, SessionDeleted
from schemas.conversation import Verdict
from schemas.history import turn_messages
from workers.engine import Engine, EngineDead, EngineRejected, warm_up
from workers.fairness import FairQueue
from workers.flights import Flights, InFlight
from workers.history import Histories, HistoryReader
from workers.intake import Intake, keyring_of
from workers.ledger import Ledgers
from workers.metrics import Readings, WorkerMetrics
from workers.offsets import OffsetTracker
from workers.output import Output
from workers.plan import Action, plan_start
from workers.recovery import Found
from workers.settings import WorkerSettings
from workers.takeover import Handover, Rebalances, logged_at
from workers.turn import Interrupted, Runner, Traced, Turn, Waiting

log = logging.getLogger(__name__)
POLL_RECORDS = 200
# How often offsets that moved without anything to write (skipped prompts, turns whose
# end was in the last transaction) are committed on their own.
COMMIT_INTERVAL_S = 0.2
# The consumer's long poll. Short polls cost the broker about 0.2 ms of CPU each even
# when they bring nothing (measured: 3 consumers polling every 10 ms kept 5% of a core
# busy), and a worker's prompts and control events arrive at once however long it is:
# only a partition resumed or assigned while a poll is out waits for that poll to end.
FETCH_WAIT_MS = 100
# Prompts a full worker keeps taken and waiting beyond ``max_num_seqs``, per 8 slots:
# a slot that frees is filled from them at once, so the prompts fetched after the
# resume (up to ``FETCH_WAIT_MS`` later) only refill them.
PREFETCH_PER_8_SLOTS = 1


class Worker:
    """``settings``: the worker's (``WORKER_*``); ``codec``: opens prompts and seals
    replies with the conversations' keys (its keyring's, ``pipeline.keystore``);
    ``limits``: the largest record each topic it writes takes; ``compression``: the
    pipeline's (``PIPELINE_COMPRESSION``). Built on the event loop that runs it
    (``opened`` reads the limits first), whole."""

    @classmethod
    async def opened(cls, engine: Engine, bootstrap: str, registry: CollectorRegistry,
                     settings: WorkerSettings, codec: Codec, *, name: str = "",
                     max_record_bytes: int = 8 * 2**20, compression: str = "zstd") -> Worker:
        """A worker whose writer knows its topics' limits (``max_record_bytes`` where the
        cluster says none: ``PIPELINE_MAX_RECORD_BYTES``)."""
        limits = await asyncio.to_thread(topic_limits, bootstrap, [GENERATIONS, LIVE],
                                         max_record_bytes)
        return cls(engine, bootstrap, registry, settings, codec, name=name, limits=limits,
                   compression=compression)

    def __init__(self, engine: Engine, bootstrap: str, registry: CollectorRegistry,
                 settings: WorkerSettings, codec: Codec, *, name: str,
                 limits: Mapping[str, int], compression: str) -> None:
        self.engine, self.bootstrap, self.settings = engine, bootstrap, settings
        self.codec = codec
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.loop = asyncio.get_running_loop()
        # Unique per process unless configured: a stable id (one per worker slot) lets a
        # restarted worker fence its predecessor's open transaction at once.
        self.transactional_id = (settings.transactional_id
                                 or f"chat-worker-{self.name}-{uuid.uuid4().hex[:8]}")
        self.tracker = OffsetTracker()
        self.broker_clock = BrokerClock()  # read off its heartbeats: broker-stamped
        self.flights = Flights(engine.abort, lambda: self.broker_clock.ahead_s)
        # Prompts read and waiting for a slot, started by a fair share between tenants.
        self.waiting: FairQueue[Waiting] = FairQueue(
            lambda w: w.prompt.tenant, settings.weights, settings.max_running_per_tenant,
            size_of=Waiting.chars, fair=settings.scheduling == "fair",
            slots=engine.max_num_seqs if settings.preempt else None)
        self._preempting = 0  # turns stopped to give their slot up, not yet off the engine
        # Prompts being taken, a lane per partition: the loop never waits on one.
        self.intake = Intake(self._take, self._stalled, self._lane_failed,
                             settings.intake_timeout_s, keyring_of(codec))
        self.peak_in_flight = 0
        self.recovered = Found()
        self.ledgers = Ledgers(bootstrap)
        self.consumer = GroupConsumer(
            bootstrap, workers_group(engine.model_name), engine.model_name,
            **{"session.timeout.ms": settings.session_timeout_ms,
               # A worker owns the same partition number of both topics.
               "partition.assignment.strategy": "range", "fetch.wait.max.ms": FETCH_WAIT_MS})
        writing = TransactionSettings(
            settings.transaction_timeout_ms, not settings.transactional_id,
            settings.transaction_interval_ms, gathers=True, compression=compression,
            max_record_bytes=max(limits.values()), limits=tuple(limits.items()))
        self.writer = TransactionalProducer(
            bootstrap, self.transactional_id, writing, self.tracker.positions,
            on_committed=self.tracker.mark_committed, on_fenced=self._on_fenced,
            offset_metadata=self.tracker.describe)
        self.output = Output(self.writer, self.name, codec)
        self.metrics = WorkerMetrics(registry, engine, Readings(
            lambda: max(len(self.flights) - engine.running(), 0) + len(self.waiting),
            lambda: self.writer.transactions, lambda: self.histories.chars,
            lambda: self.output.records, lambda: self.broker_clock.ahead_s))
        self._history_reader = HistoryReader(bootstrap, f"worker-history-{self.name}")
        self.histories = Histories(self._history_reader, codec, self.metrics.histories,
                                   settings.history_cache_chars)
        self.runner = Runner(engine, self.output, self.writer, self.histories, self.metrics,
                             self.name, self.waiting.served)
        # Kafka taking tokens slower than they come: the engine's outputs wait, merged.
        engine.pace(self.writer.congested)
        self.assignments = 0  # bumped by each assignment, so the loop re-applies pausing
        self._fenced = asyncio.Event()
        self._rejoin = False  # a refusal that no rebalance answers: leave and rejoin
        self._refused: object = None  # the group metadata the latest refusal showed
        self._fatal: BaseException | None = None
        self._stopping = False

    @property
    def capacity(self) -> int:
        """Prompts taken at most: those the engine runs, and ``read_ahead`` waiting (a
        few per 8 slots at least): the fair share chooses among those read."""
        slots = self.engine.max_num_seqs
        return slots + max(self.settings.read_ahead, slots * PREFETCH_PER_8_SLOTS // 8)

    # -- the loop ---------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        consumer = self.consumer
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
                              load=self.waiting.load, clock=self.broker_clock)
        rebalances = Rebalances(self, self.bootstrap, consumer, self.flights, self.codec,
                                self.engine.model_name, self.settings.recovery_window_s,
                                self.settings.transaction_timeout_ms)
        consumer.subscribe([PROMPTS, CONTROL], on_assign=rebalances.on_assign,
                           on_revoke=rebalances.on_revoke)
        paused: bool | None = None  # as applied to the assignment of version `applied`
        applied = -1
        last_lag = last_commit = 0.0
        stalls = StallWatch(consumer, LogReader(self.bootstrap, f"ends-{self.name}", "ends"))
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
                    # transactions with a rebalance, and they would rejoin in turn.) One
                    # of an older assignment was answered: its revocation dropped the
                    # turns, and those restarted since stay (else they wait for one).
                    self._fenced.clear()
                    rejoin, self._rejoin = self._rejoin, False
                    if self._refused is self.writer.group:
                        await self.abandon(self.ledgers.partitions)
                        self.output.drop()
                        if rejoin:
                            await consumer.rejoin()
                full = (len(self.flights) + len(self.waiting) + len(self.intake) >= self.capacity
                        or self.waiting.size >= self.settings.read_ahead_chars)
                # A new assignment may hold partitions paused before a rebalance, or
                # none paused while the engine is full: set the state anew each time.
                if full != paused or applied != self.assignments:
                    applied, paused = self.assignments, full
                    await (consumer.pause if full else consumer.resume)(PROMPTS)
                # Paused, only control events come: poll briefly, to see freed slots soon.
                polled = await consumer.poll_batch(POLL_RECORDS, 0.02 if full else 0.05)
                ahead = self.intake.keys_ahead(polled, self.engine.model_name)  # together
                for record in polled:
                    if record.position.topic == PROMPTS:  # taken in its partition's lane
                        self.tracker.taken((PROMPTS, record.position.partition),
                                           record.position.offset)
                        self.intake.put(record, ahead.get(record.position))
                    else:  # control events at once, whatever a prompt waits for
                        await self._take(record)
                # An engine found dead (idle, say) starts nothing more: the worker exits.
                self._fatal = self._fatal or self.writer.failed or self.engine.dead()
                self._start_waiting()
                heartbeat.beat()
                if time.monotonic() - last_commit > COMMIT_INTERVAL_S:
                    # Every record polled so far is taken: the consumer's position may pass
                    # transaction markers, so the group's lag reaches 0 when all is done.
                    self.tracker.advance({tp: o for tp, o in (await consumer.positions()).items()
                                          if tp[0] == PROMPTS})
                    if self.tracker.committable() or self.tracker.stale_descriptions():
                        # Offsets moved, or the work waiting changed: the transactions of
                        # the engine's steps commit them while it runs (each commits the
                        # offsets as they then are), a transaction of their own once
                        # the log has been quiet for the interval.
                        self.writer.commit_offsets(COMMIT_INTERVAL_S)
                    last_commit = time.monotonic()
                if time.monotonic() - last_lag > 1.0:
                    lag = {tp: n for tp, n in (await consumer.lag()).items()
                           if tp[0] == PROMPTS}
                    self.metrics.lag.set(sum(lag.values()))
                    await stalls.check(lag, bool(paused))
                    last_lag = time.monotonic()
            self._stopping = True
            await self._drain()
        finally:
            await self.intake.close()
            await asyncio.to_thread(heartbeat.leave)
            await asyncio.to_thread(self.writer.close)
            await asyncio.gather(consumer.close(), stalls.close())
            await self._history_reader.close()
        if self._fatal is not None:
            raise self._fatal

    async def _drain(self, grace_s: float = 30.0) -> None:
        tasks = [f.task for f in self.flights.running.values()]
        if tasks:
            log.info("waiting for %d generations to finish", len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()

    # -- records ------------------------------------------------------------------
    async def _take(self, record: Record) -> None:
        """What a record means here: a prompt to wait for a slot (or not to run), a control
        event applied, or a record that does not decode dead-lettered. A prompt's was
        counted taken (``tracker.taken``) when it was polled."""
        topic, partition, offset = record.position.topic, record.position.partition, \
            record.position.offset
        try:
            event, key = await self.codec.decode_keyed_async(record.value, lambda e: not (
                isinstance(e, PromptSubmitted) and e.model != self.engine.model_name))
        except DecodeError as exc:
            log.warning("dead-lettering %s: %s", record.position, exc)
            self.metrics.dead_letters.inc()
            await self.output.dead_letter(record, str(exc))
            self._done((topic, partition), offset)
            return
        if not isinstance(event, PromptSubmitted):
            # Control events; also found in chat.prompts when written by gateways from
            # before chat.control existed.
            if isinstance(event, SessionDeleted):  # no plaintext of it stays here
                self.histories.forget(event.conversation_id)
            await self.flights.control(event, logged_at(record))
            self._done((topic, partition), offset)
            return
        # Judged whatever its model (another's left sealed): every group keeps the ledger.
        verdict = await self.ledgers.judge(event, partition, offset)
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
                                  else Traced(parent, record.timestamp_ms),
                                  key if key is not None else "erased" if event.erased
                                  else None))
        self._start_waiting()  # a free slot takes it now, not at the loop's next turn

    async def _stalled(self, record: Record) -> None:
        """A prompt whose taking passed WORKER_INTAKE_TIMEOUT_S: dead-lettered, so its
        partition's next prompts go on."""
        reason = (f"taking it passed WORKER_INTAKE_TIMEOUT_S ({self.intake.timeout_s:g} s): "
                  "its key or its partition's ledger could not be read")
        log.error("dead-lettering %s: %s", record.position, reason)
        self.metrics.dead_letters.inc()
        await self.output.dead_letter(record, reason)
        self._done((record.position.topic, record.position.partition),
                   record.position.offset)

    def _lane_failed(self, exc: BaseException) -> None:
        self._fatal = exc  # the loop stops, and the worker with it: never a lane lost

    def _done(self, tp: TP, offset: int) -> None:
        if tp[0] == PROMPTS:
            self.tracker.done(tp, offset)

    def _start_waiting(self) -> None:
        if self._stopping or self._fatal is not None:
            return  # left in the log for the partitions' next owner
        while len(self.flights) < self.engine.max_num_seqs:
            item = self.waiting.pop()
            if item is None:
                return  # nothing waits, or only tenants at their cap
            self.tracker.started(item.tp, item.offset)
            if not self._start(item):
                self.waiting.ended(item.prompt.tenant)
        if self.waiting and not self._preempting:
            self._preempt()

    def _preempt(self) -> None:
        """Every slot is taken and a tenant below its share waits: stop a turn of the
        tenant furthest above its share (``workers.fairness``). Its task puts it back to
        wait once the engine let it go (``_run_turn``), and the freed slot goes to the
        tenant that waits."""
        tenant = self.waiting.victim()
        flight = None if tenant is None else self.flights.newest_of(tenant)
        if flight is None:
            return
        flight.preempted = True
        self._preempting += 1
        self.waiting.ended(flight.prompt.tenant)
        self.metrics.preempted.inc()
        flight.task.cancel()

    def _start(self, item: Waiting) -> bool:
        """Start a turn (False: it needs not run: it ran, or runs, already)."""
        prompt, tp, offset, traced, seal = item.prompt, item.tp, item.offset, item.trace, \
            item.seal
        rid = prompt.request_id
        plan = plan_start(prompt, self.recovered.take(rid, tp[1], offset),
                          self.flights.known(rid), self.flights.book,
                          self.flights.log_now(), item.stopped)
        if plan.action is Action.SKIP:  # never run twice
            self._done(tp, offset)
            return False
        turn = Turn(prompt, tp, offset, plan.progress, self.writer.epoch, traced, seal=seal)
        if plan.action is Action.END:
            log.info("not starting %s: %s", rid, plan.reason, extra=turn_fields(prompt))
            self.metrics.unstarted.inc()
        task = asyncio.create_task(self._run_turn(turn, plan.action is Action.RUN))
        self.flights.add(InFlight(tp, task, prompt), run=plan.action is Action.RUN)
        self.peak_in_flight = max(self.peak_in_flight, len(self.flights))
        self.metrics.in_flight_peak.set(self.peak_in_flight)
        return True

    # -- one turn ----------------------------------------------------------------
    async def _run_turn(self, turn: Turn, run: bool) -> None:
        """Run the turn (``run``; else end it unstarted), then write its end."""
        self.flights.on_engine(turn.prompt.request_id, run)
        try:
            final = await self.runner.run(turn) if run else self.runner.unstarted(turn)
            self.flights.on_engine(turn.prompt.request_id, False)
        except asyncio.CancelledError:
            # Abandoned on revoke or shutdown: no terminal event, the offset stays
            # uncommitted, and the next owner resumes from what was emitted (tokens
            # still held back here are generated again by the next owner).
            flight = self._forget(turn.prompt.request_id)
            if flight is not None and flight.preempted and not flight.abandoned \
                    and not self._stopping:
                # Stopped to give its slot up: it waits again, first of its tenant's,
                # and continues after the deltas it wrote.
                self.tracker.queued(turn.tp, turn.offset)
                self.waiting.requeue(Waiting(turn.prompt, turn.tp, turn.offset, turn.traced,
                                             turn.seal, turn.progress))
                self._start_waiting()
                return
            raise
        except Interrupted as exc:  # its offset left uncommitted: its next owner resumes it
            self._fatal = EngineDead(str(exc))  # the worker exits
            self._forget(turn.prompt.request_id)
            return
        if isinstance(final, GenerationFailed) and final.code == "engine_dead":
            self._fatal = EngineDead(final.message)
        await self._finish(turn, final)

    async def _finish(self, turn: Turn, final: GenerationFinished | GenerationFailed) -> None:
        """Write the turn's end (``Runner.end``); once it is committed, so is (in the next
        transaction) the prompt's offset."""
        prompt, tp, offset = turn.prompt, turn.tp, turn.offset
        try:
            final = await self.runner.end(turn, final)
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
        if turn.history is not None and not self.flights.book.deleted(
                prompt.conversation_id) and not self.codec.cipher.revoked(prompt.conversation_id):
            self.histories.remember(prompt.conversation_id, offset,
                                    turn.history + turn_messages(prompt, final))
        self._forget(prompt.request_id, ended=True)

    def _forget(self, request_id: str, ended: bool = False) -> InFlight | None:
        flight = self.flights.forget(request_id, ended)
        if flight is not None:
            if flight.preempted:  # counted ended when it was stopped
                self._preempting -= 1
            else:
                self.waiting.ended(flight.prompt.tenant)
        if ended:
            self._start_waiting()  # the slot is free now, not at the loop's next turn
        return flight

    # -- partitions handed over and taken away (``Rebalances``), transactions refused
    def took_over(self, handover: Handover, group: object) -> None:
        """On the consumer's thread: where prompts start, what earlier owners left."""
        for p, offset in handover.committed.items():
            self.tracker.start((PROMPTS, p), offset)
        self.recovered = handover.found  # an assignment is whole: earlier findings are stale
        self.ledgers.assign(handover.committed)
        self.writer.set_group(group)  # the new generation, for every transaction from now
        self.assignments += 1
        self.metrics.assigned.set(len(handover.committed))

    def give_up(self, partitions: list[int]) -> None:
        """On the consumer's thread: abandon the partitions' turns, committing nothing
        (the rebalance waits for this; a transaction's group check, for the rebalance).
        What was not yet in a transaction is dropped, and one in flight passed its check
        before the generation ended (the next owner's scan waits for it) or is refused:
        the next owner regenerates the rest."""
        asyncio.run_coroutine_threadsafe(self.abandon(partitions), self.loop).result(30)
        self.writer.new_epoch()
        self.tracker.forget([(PROMPTS, p) for p in partitions])
        self.ledgers.drop(partitions)
        self.metrics.assigned.set(len(self.ledgers))

    async def abandon(self, partitions: list[int]) -> None:
        """Stop this worker's turns in ``partitions``; their next owner resumes them."""
        # Prompts being taken, then waiting ones: a turn that ends meanwhile starts the
        # next waiting one.
        await self.intake.drop(partitions)
        self.waiting.remove(lambda w: w.tp[1] in partitions)
        flights = self.flights.in_partitions(partitions)
        for flight in flights:
            flight.abandoned = True
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in flights), return_exceptions=True)
        for flight in flights:  # cancelled before their task began: nothing forgot them
            if self.flights.running.get(flight.prompt.request_id) is flight:
                self._forget(flight.prompt.request_id)
        self.output.drop(partitions)  # what they wrote but did not yet queue
        if flights:
            log.info("handed %d unfinished turns to the next owner", len(flights))

    def _on_fenced(self, answered: bool, group: object) -> None:
        """The broker refused a transaction showing ``group`` (called on the writer's
        thread); ``answered``: an assignment under way, or made since, starts the dropped
        turns again."""
        self.metrics.fenced.inc()
        self._rejoin, self._refused = self._rejoin or not answered, group
        self.loop.call_soon_threadsafe(self._fenced.set)
