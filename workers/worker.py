"""The worker: consumes ``chat.prompts`` in group ``workers`` and runs many prompts at once.

* Every prompt becomes its own task on one engine, so the engine batches them continuously.
* Fetching pauses while ``max_num_seqs`` generations are in flight.
* A prompt's offset is committed only once its generation's terminal event is durable
  (low watermark of in-flight offsets per partition).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.codec import DecodeError, decode
from pipeline.deadletter import dead_letter
from pipeline.kafka import AsyncConsumer, EventProducer, KafkaException, Record
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import (
    EventIds,
    FinishReason,
    GenerationCancelled,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
    Usage,
)
from workers.engine import Engine, EngineDead, EngineRejected, EngineRequest
from workers.offsets import OffsetTracker

log = logging.getLogger(__name__)
GROUP = "workers"
COMMIT_INTERVAL_S = 0.1


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.running = Gauge("worker_running_sequences", "Generations in flight",
                             registry=registry)
        self.tokens = Counter("worker_generated_tokens", "Tokens generated", registry=registry)
        self.generations = Counter("worker_generations", "Generations ended, by outcome",
                                   ["outcome"], registry=registry)
        self.ttft = Histogram("worker_ttft_seconds", "Time from prompt taken to first token",
                              registry=registry,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.dead_letters = Counter("worker_dead_letters", "Prompts sent to the dead-letter topic",
                                    registry=registry)


@dataclass
class InFlight:
    task: asyncio.Task[None]
    cancelled: bool = False


class Worker:
    def __init__(
        self, engine: Engine, bootstrap: str, registry: CollectorRegistry, name: str = ""
    ) -> None:
        self.engine = engine
        self.bootstrap = bootstrap
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = WorkerMetrics(registry)
        self.tracker = OffsetTracker()
        self.in_flight: dict[str, InFlight] = {}
        self._slot_freed = asyncio.Event()
        self._fatal: BaseException | None = None
        self._producer: EventProducer | None = None

    # -- consumer side -------------------------------------------------------
    def _on_revoke(self, consumer: AsyncConsumer, revoked: list[tuple[str, int]]) -> None:
        safe = {tp: o for tp, o in self.tracker.committable().items() if tp in revoked}
        try:
            consumer.commit_sync(safe)
        except KafkaException as exc:  # the next owner re-reads from the last commit
            log.warning("commit on revoke failed: %s", exc)
        self.tracker.forget(revoked)

    async def run(self, stop: asyncio.Event) -> None:
        self._producer = EventProducer(self.bootstrap)
        consumer = AsyncConsumer(self.bootstrap, GROUP)
        consumer.subscribe([PROMPTS], on_revoke=lambda tps: self._on_revoke(consumer, tps))
        paused = False
        last_commit = 0.0
        try:
            while not stop.is_set() and self._fatal is None:
                free = self.engine.max_num_seqs - len(self.in_flight)
                if free <= 0 and not paused:
                    await consumer.call(consumer.pause_all_sync)
                    paused = True
                elif free > 0 and paused:
                    await consumer.call(consumer.resume_all_sync)
                    paused = False
                if paused:
                    self._slot_freed.clear()
                    try:
                        await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                    except TimeoutError:
                        await consumer.poll_batch(1, 0)  # serve rebalances while paused
                    continue
                for record in await consumer.poll_batch(free, 0.05):
                    await self._take(record)
                if time.monotonic() - last_commit > COMMIT_INTERVAL_S:
                    await self._commit(consumer)
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
        try:
            event = decode(record.value)
        except DecodeError as exc:
            await dead_letter(self._producer, record, str(exc), GROUP)
            self.metrics.dead_letters.inc()
            self.tracker.taken(tp, record.position.offset)
            self.tracker.done(tp, record.position.offset)
            return
        self.tracker.taken(tp, record.position.offset)
        if isinstance(event, PromptSubmitted):
            task = asyncio.create_task(self._generate(event, tp, record.position.offset))
            self.in_flight[event.request_id] = InFlight(task)
            self.metrics.running.set(len(self.in_flight))
            return
        if isinstance(event, GenerationCancelled):
            flight = self.in_flight.get(event.request_id)
            if flight is not None and not flight.cancelled:
                flight.cancelled = True
                await self.engine.abort(event.request_id)
        self.tracker.done(tp, record.position.offset)

    # -- generation side -----------------------------------------------------
    async def _generate(self, prompt: PromptSubmitted, tp: tuple[str, int], offset: int) -> None:
        assert self._producer is not None
        ids = EventIds(conversation_id=prompt.conversation_id, request_id=prompt.request_id,
                       tenant=prompt.tenant)
        started = time.monotonic()
        ttft: float | None = None
        parts: list[str] = []
        completion_tokens = prompt_tokens = 0
        finish_reason: FinishReason = "abort"
        final: GenerationFinished | GenerationFailed
        try:
            if prompt.model != self.engine.model_name:
                raise EngineRejected("model_not_served", f"This worker serves "
                                     f"'{self.engine.model_name}', not '{prompt.model}'.")
            request = EngineRequest(prompt.request_id, prompt.messages, prompt.sampling)
            async for out in self.engine.generate(request):
                if ttft is None:
                    ttft = time.monotonic() - started
                    prompt_tokens = out.prompt_tokens
                    self.metrics.ttft.observe(ttft)
                    self._producer.send(GENERATIONS, GenerationStarted(
                        **ids, model=self.engine.model_name, worker=self.name,
                        reply_seq=prompt.reply_seq, prompt_tokens=prompt_tokens))
                if out.text or out.token_ids:
                    self._producer.send(GENERATIONS, TokenDelta(
                        **ids, seq=len(parts), text=out.text, token_ids=out.token_ids))
                    parts.append(out.text)
                    completion_tokens += len(out.token_ids)
                    self.metrics.tokens.inc(len(out.token_ids))
                if out.finish_reason in ("stop", "length"):
                    finish_reason = "stop" if out.finish_reason == "stop" else "length"
            final = GenerationFinished(
                **ids, model=self.engine.model_name, reply_seq=prompt.reply_seq,
                finish_reason=finish_reason,
                text="".join(parts), deltas=len(parts),
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
                ttft_ms=None if ttft is None else ttft * 1000,
                duration_ms=(time.monotonic() - started) * 1000,
            )
        except EngineRejected as exc:
            final = GenerationFailed(**ids, code=exc.code, message=str(exc))
        except EngineDead as exc:
            final = GenerationFailed(**ids, code="engine_dead", message=str(exc))
            self._fatal = exc
        except Exception as exc:
            log.exception("generation %s failed", prompt.request_id)
            final = GenerationFailed(**ids, code="internal_error", message=type(exc).__name__)
        try:
            await self._producer.send(GENERATIONS, final)
        except Exception as exc:  # the turn stays uncommitted and is redelivered
            log.error("could not record the end of %s: %s", prompt.request_id, exc)
            self._fatal = exc
        else:
            self.tracker.done(tp, offset)
        outcome = final.finish_reason if isinstance(final, GenerationFinished) else final.code
        self.metrics.generations.labels(outcome).inc()
        self.in_flight.pop(prompt.request_id, None)
        self.metrics.running.set(len(self.in_flight))
        self._slot_freed.set()
