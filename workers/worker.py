"""The worker: consumes ``chat.prompts`` in group ``workers`` and runs many prompts at once.

* Every prompt becomes its own task on one engine, so the engine batches them
  continuously; fetching pauses while ``max_num_seqs`` generations are in flight.
* A prompt's offset is committed only once its generation's terminal event is
  durable (the low watermark of in-flight offsets per partition).
* Clients come and go: ``ClientDetached`` starts a grace period after which the turn
  is stopped unless a ``ClientAttached`` arrives first (``background`` turns never
  stop for that); ``GenerationCancelled`` stops it at once; ``SessionDeleted`` stops
  every turn of the session. These facts are in the log, so a worker taking over
  sees them too.
* Takeover: a worker handed a partition first reads what earlier owners left in
  the log (``workers.recovery``). Turns that ended are not run again; unfinished
  ones continue after their emitted tokens, under the next ``attempt``, with
  ``seq`` carrying on. A worker losing a partition abandons its turns there before
  the rebalance completes, so two owners never write the same turn at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import DecodeError, decode
from pipeline.deadletter import dead_letter
from pipeline.kafka import (
    QUICK_ASSIGN,
    AsyncConsumer,
    EventProducer,
    KafkaException,
    Record,
    scan_partitions,
)
from pipeline.topics import GENERATIONS, PROMPTS, WORKERS_GROUP, worker_client_id
from schemas import (
    ClientAttached,
    ClientDetached,
    EventIds,
    FinishReason,
    GenerationCancelled,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SessionDeleted,
    TokenDelta,
    Usage,
)
from workers.engine import Engine, EngineDead, EngineRejected, EngineRequest
from workers.offsets import OffsetTracker
from workers.recovery import Recovered, from_log

log = logging.getLogger(__name__)
GROUP = WORKERS_GROUP
COMMIT_INTERVAL_S = 0.1
TP = tuple[str, int]
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Turns that ended here, remembered so a re-submitted prompt (an idempotent retry
# racing its original) is not run twice.
ENDED_MEMORY = 100_000


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker: Worker) -> None:
        engine = worker.engine
        Gauge("worker_running_sequences", "Generations the engine is running",
              registry=registry).set_function(engine.running)
        Gauge("worker_waiting_sequences", "Generations taken but not yet running in the engine",
              registry=registry).set_function(
                  lambda: max(len(worker.in_flight) - engine.running(), 0))
        Gauge("worker_batch_utilisation", "Running sequences / max_num_seqs",
              registry=registry).set_function(lambda: engine.running() / engine.max_num_seqs)
        Gauge("worker_kv_cache_usage", "KV-cache usage as the engine reports it (0-1)",
              registry=registry).set_function(lambda: engine.kv_cache_usage() or 0.0)
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
        self.dead_letters = Counter("worker_dead_letters", "Prompts sent to the dead-letter topic",
                                    registry=registry)


@dataclass
class InFlight:
    tp: TP
    task: asyncio.Task[None]
    prompt: PromptSubmitted
    # The clients following the turn; the original request is attached from the start.
    attached: set[str] = field(default_factory=set)
    grace: asyncio.Task[None] | None = None
    cancelled: bool = False


@dataclass
class Progress:
    """A turn's generation so far, including what earlier attempts emitted."""

    attempt: int = 0
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def resumed(cls, rec: Recovered) -> Progress:
        emitted = rec.emitted()
        return cls(rec.attempt + 1, [d.text for d in emitted],
                   [t for d in emitted for t in d.token_ids])


class Worker:
    def __init__(
        self, engine: Engine, bootstrap: str, registry: CollectorRegistry, name: str = "",
        *, session_timeout_ms: int = 10_000, recovery_window_s: float = 300.0,
        coalesce_ms: float = 10.0,
    ) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.session_timeout_ms = session_timeout_ms
        self.recovery_window_s = recovery_window_s
        self.coalesce_s = coalesce_ms / 1000
        self.tracker = OffsetTracker()
        self.in_flight: dict[str, InFlight] = {}
        self.peak_in_flight = 0
        self.recovered: dict[str, Recovered] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.metrics = WorkerMetrics(registry, self)
        self._slot_freed = asyncio.Event()
        self._assignments = 0  # bumped by each assignment, so the loop re-applies pausing
        self._fatal: BaseException | None = None
        self._producer: EventProducer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- rebalances (these run on the consumer's thread, inside a poll) -------
    def _on_assign(self, assigned: list[TP]) -> None:
        partitions = [p for t, p in assigned if t == PROMPTS]
        since_ms = int((time.time() - self.recovery_window_s) * 1000)
        records = scan_partitions(self.bootstrap, GENERATIONS, partitions, since_ms)
        # Ended turns come back with their mark only; unfinished ones with their deltas.
        found = {rid: rec for rid, rec in from_log([r.value for r in records]).items()
                 if rid not in self.in_flight}
        self.recovered = found  # an assignment is whole: earlier findings are stale
        self._assignments += 1
        self.metrics.assigned.set(len(partitions))
        unfinished = sum(not r.ended for r in found.values())
        log.info("assigned %s; %d recent turns in the log, %d unfinished",
                 partitions, len(found), unfinished)

    def _on_revoke(self, consumer: AsyncConsumer, revoked: list[TP]) -> None:
        assert self._loop is not None
        abandon = asyncio.run_coroutine_threadsafe(self._abandon(revoked), self._loop)
        abandon.result(timeout=60)
        safe = {tp: o for tp, o in self.tracker.committable().items() if tp in revoked}
        try:
            consumer.commit_sync(safe)
        except KafkaException as exc:  # the next owner re-reads from the last commit
            log.warning("commit on revoke failed: %s", exc)
        self.tracker.forget(revoked)
        self.metrics.assigned.set(0)  # eager rebalancing: everything is handed back

    async def _abandon(self, revoked: list[TP]) -> None:
        """Stop this worker's turns in revoked partitions; their new owner resumes them."""
        flights = [f for f in self.in_flight.values() if f.tp in revoked]
        for flight in flights:
            flight.task.cancel()
        await asyncio.gather(*(f.task for f in flights), return_exceptions=True)
        assert self._producer is not None
        await asyncio.to_thread(self._producer.flush, 30)
        if flights:
            log.info("handed %d unfinished turns to the next owner", len(flights))

    # -- the loop ---------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._producer = EventProducer(self.bootstrap)
        consumer = AsyncConsumer(self.bootstrap, GROUP,
                                 **{"session.timeout.ms": self.session_timeout_ms,
                                    "client.id": worker_client_id(self.engine.model_name),
                                    # Resumed partitions join the fetches at once.
                                    **QUICK_ASSIGN})
        consumer.subscribe([PROMPTS], on_assign=self._on_assign,
                           on_revoke=lambda tps: self._on_revoke(consumer, tps))
        paused: bool | None = None  # as applied to the assignment of version `applied`
        applied = -1
        last_commit = 0.0
        try:
            while not stop.is_set() and self._fatal is None:
                free = self.engine.max_num_seqs - len(self.in_flight)
                # A new assignment may hold partitions paused before a rebalance, or
                # none paused while the engine is full: set the state anew each time.
                if (free <= 0) != paused or applied != self._assignments:
                    applied = self._assignments
                    paused = free <= 0
                    await consumer.call(consumer.pause_all_sync if paused
                                        else consumer.resume_all_sync)
                if paused:
                    self._slot_freed.clear()
                    if len(self.in_flight) < self.engine.max_num_seqs:
                        continue  # a turn ended while pausing (its signal just cleared)
                    try:
                        await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                    except TimeoutError:
                        # Serve rebalances while paused. A record can still arrive (from
                        # a partition just assigned): take it, never drop it.
                        for record in await consumer.poll_batch(1, 0):
                            await self._take(record)
                else:
                    for record in await consumer.poll_batch(free, 0.05):
                        await self._take(record)
                if time.monotonic() - last_commit > COMMIT_INTERVAL_S:
                    await self._commit(consumer)
                    self.metrics.lag.set(sum((await consumer.call(consumer.lag_sync)).values()))
                    last_commit = time.monotonic()
            await self._drain()
            await self._commit(consumer)
        finally:
            await consumer.close()
            self._producer.close()
        if self._fatal is not None:
            raise self._fatal

    async def _commit(self, consumer: AsyncConsumer) -> None:
        """Commit the safe positions; on failure keep them pending and retry next time."""
        positions = self.tracker.committable()
        try:
            await consumer.commit(positions)
        except KafkaException as exc:
            log.warning("offset commit failed, will retry: %s", exc)
            return
        self.tracker.mark_committed(positions)

    async def _drain(self, grace_s: float = 30.0) -> None:
        tasks = [f.task for f in self.in_flight.values()]
        if tasks:
            log.info("waiting for %d generations to finish", len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()

    async def _take(self, record: Record) -> None:
        assert self._producer is not None
        tp = (record.position.topic, record.position.partition)
        offset = record.position.offset
        self.tracker.taken(tp, offset)
        try:
            event = decode(record.value)
        except DecodeError as exc:
            await dead_letter(self._producer, record, str(exc), GROUP)
            self.metrics.dead_letters.inc()
            self.tracker.done(tp, offset)
            return
        if isinstance(event, PromptSubmitted):
            self._start(event, tp, offset)
            return
        flight = self.in_flight.get(event.request_id)
        if isinstance(event, GenerationCancelled) and flight is not None:
            await self._cancel(flight)
        elif isinstance(event, ClientDetached) and flight is not None:
            flight.attached.discard(event.attachment)
            if not flight.attached and not flight.prompt.background and flight.grace is None:
                age = (datetime.now(UTC) - event.occurred_at).total_seconds()
                flight.grace = asyncio.create_task(
                    self._cancel(flight, after_s=max(event.grace_s - age, 0.0)))
        elif isinstance(event, ClientAttached) and flight is not None:
            flight.attached.add(event.attachment)
            if flight.grace is not None:
                flight.grace.cancel()
                flight.grace = None
        elif isinstance(event, SessionDeleted):
            for other in list(self.in_flight.values()):
                if other.prompt.conversation_id == event.conversation_id:
                    await self._cancel(other)
        self.tracker.done(tp, offset)

    def _start(self, prompt: PromptSubmitted, tp: TP, offset: int) -> None:
        rid = prompt.request_id
        rec = self.recovered.pop(rid, None)
        if (rec is not None and rec.ended) or rid in self.ended or rid in self.in_flight:
            # It ended before its offset was committed, or it is a re-submission of a
            # turn that ended or is running here: either way, not run twice.
            self.tracker.done(tp, offset)
            return
        progress = Progress.resumed(rec) if rec is not None else Progress()
        task = asyncio.create_task(self._generate(prompt, tp, offset, progress))
        self.in_flight[rid] = InFlight(tp, task, prompt, attached={rid})
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        self.metrics.in_flight_peak.set(self.peak_in_flight)

    async def _cancel(self, flight: InFlight, after_s: float = 0.0) -> None:
        if after_s:
            await asyncio.sleep(after_s)
            log.info("no client came back for %s: stopping it", flight.prompt.request_id)
        if not flight.cancelled:
            flight.cancelled = True
            await self.engine.abort(flight.prompt.request_id)

    # -- one generation ------------------------------------------------------
    async def _generate(
        self, prompt: PromptSubmitted, tp: TP, offset: int, progress: Progress
    ) -> None:
        assert self._producer is not None
        ids = EventIds(conversation_id=prompt.conversation_id, request_id=prompt.request_id,
                       tenant=prompt.tenant)
        attempt = progress.attempt
        started = last_token = time.monotonic()
        last_window: int | None = None
        ttft: float | None = None
        held_text: list[str] = []
        held_ids: list[int] = []

        def emit() -> None:
            """One TokenDelta for what was held: seq stays gap-free."""
            assert self._producer is not None
            text = "".join(held_text)
            self._producer.send_nowait(GENERATIONS, TokenDelta(
                **ids, attempt=attempt, seq=len(progress.parts), text=text,
                token_ids=tuple(held_ids)))
            progress.parts.append(text)
            progress.token_ids.extend(held_ids)
            held_text.clear()
            held_ids.clear()

        prompt_tokens = 0
        finish_reason: FinishReason = "abort"
        final: GenerationFinished | GenerationFailed
        if attempt:
            self.metrics.resumed.inc()
            log.info("resuming %s at seq %d (attempt %d)", prompt.request_id,
                     len(progress.parts), attempt)
        try:
            if prompt.model != self.engine.model_name:
                raise EngineRejected("model_not_served", f"This worker serves "
                                     f"'{self.engine.model_name}', not '{prompt.model}'.")
            request = EngineRequest(prompt.request_id, prompt.messages, prompt.sampling,
                                    tuple(progress.token_ids))
            async for out in self.engine.generate(request):
                now = time.monotonic()
                if ttft is None:
                    ttft = now - started
                    prompt_tokens = out.prompt_tokens
                    self.metrics.ttft.observe(ttft)
                    self._producer.send_nowait(GENERATIONS, GenerationStarted(
                        **ids, model=self.engine.model_name, worker=self.name, attempt=attempt,
                        reply_seq=prompt.reply_seq, prompt_tokens=prompt_tokens))
                elif out.token_ids:
                    self.metrics.itl.observe((now - last_token) / len(out.token_ids))
                last_token = now
                if out.text or out.token_ids:
                    held_text.append(out.text)
                    held_ids.extend(out.token_ids)
                    self.metrics.tokens.inc(len(out.token_ids))
                    # The first tokens go at once (time to first token); later ones are
                    # coalesced per engine step, or per ``coalesce_ms`` window when set.
                    window = self._window(now)
                    if not progress.parts or window is None or window != last_window:
                        emit()
                        last_window = window
                if out.finish_reason in ("stop", "length"):
                    finish_reason = "stop" if out.finish_reason == "stop" else "length"
            if held_text or held_ids:
                emit()
            final = GenerationFinished(
                **ids, model=self.engine.model_name, attempt=attempt, reply_seq=prompt.reply_seq,
                finish_reason=finish_reason, text="".join(progress.parts),
                deltas=len(progress.parts),
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
            raise
        except EngineRejected as exc:
            final = GenerationFailed(**ids, attempt=attempt, code=exc.code, message=str(exc))
        except EngineDead as exc:
            final = GenerationFailed(**ids, attempt=attempt, code="engine_dead", message=str(exc))
            self._fatal = exc
        except Exception as exc:
            log.exception("generation %s failed", prompt.request_id)
            final = GenerationFailed(**ids, attempt=attempt, code="internal_error",
                                     message=type(exc).__name__)
        try:
            await self._producer.send(GENERATIONS, final)
        except Exception as exc:  # the turn stays uncommitted and is redelivered
            log.error("could not record the end of %s: %s", prompt.request_id, exc)
            self._fatal = exc
        else:
            self.tracker.done(tp, offset)
        outcome = final.finish_reason if isinstance(final, GenerationFinished) else final.code
        self.metrics.generations.labels(outcome).inc()
        self._forget(prompt.request_id, ended=True)

    def _window(self, now: float) -> int | None:
        """The coalescing window ``now`` falls in. Windows are the same for every turn
        of this worker, so the turns of one engine step emit their deltas together and
        the producer packs them into one request: Kafka requests per second stay near
        1000 / ``coalesce_ms`` whatever the concurrency. (Per-turn timers spread them
        out instead: one request per delta.) None: no coalescing, a delta per step."""
        return int(now / self.coalesce_s) if self.coalesce_s else None

    def _forget(self, request_id: str, ended: bool = False) -> None:
        flight = self.in_flight.pop(request_id, None)
        if flight is not None and flight.grace is not None:
            flight.grace.cancel()
        if ended:
            self.ended[request_id] = None
            while len(self.ended) > ENDED_MEMORY:
                self.ended.popitem(last=False)
        self._slot_freed.set()
