"""One turn on the engine: its input (the session's history, then the prompt's new
messages), its run, its deltas to the live stream and the event that ends it.

The worker decides which turns run and when (``workers.worker``); a ``Runner`` runs one
and returns its end, which the worker writes. A turn that continues an earlier attempt
(``workers.plan.Progress``) carries on after the deltas that attempt wrote, with ``seq``
going on from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.codec import TP, SealWith, conversation_key
from pipeline.kafka import TransactionalProducer
from pipeline.logs import turn_fields
from pipeline.topics import GENERATIONS
from pipeline.tracing import TRACER, Context, Span, carrier_of, ms_to_ns
from schemas import (
    EventIds,
    FinishReason,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    Usage,
)
from schemas.history import History, recall
from workers.engine import Engine, EngineDead, EngineRejected, EngineRequest
from workers.history import Histories, HistoryUnavailable
from workers.metrics import WorkerMetrics
from workers.output import Output
from workers.plan import Progress

log = logging.getLogger(__name__)
Final = GenerationFinished | GenerationFailed


@dataclass(frozen=True)
class Traced:
    """A prompt's trace context (its record's headers) and when the log appended it."""

    parent: Context
    appended_ms: int


@dataclass
class Waiting:
    """A prompt taken from the log, waiting for a slot on the engine."""

    prompt: PromptSubmitted
    tp: TP
    offset: int
    trace: Traced | None = None
    # What its turn's text is sealed with: the key its prompt was opened with (None: the
    # prompt was in the clear; ``"erased"``: its keys were destroyed).
    seal: SealWith = None
    # What an attempt stopped to give its slot up wrote (None: it never ran here).
    stopped: Progress | None = None

    def chars(self) -> int:
        """What it holds in memory, in characters (what bounds the read-ahead)."""
        prompt = self.prompt
        return sum(len(m.content) for m in (*prompt.messages, *(prompt.history or ())))


@dataclass
class Turn:
    """A turn started here: its prompt and where it is in the log, what earlier attempts
    wrote, the writer's epoch it writes under, and its trace."""

    prompt: PromptSubmitted
    tp: TP
    offset: int
    progress: Progress
    epoch: int
    traced: Traced | None = None
    history: History | None = None  # once read: the session before this turn
    seal: SealWith = None  # as its prompt's (``Waiting.seal``)
    streamed: bool = False  # this attempt had its first output from the engine

    @property
    def ids(self) -> EventIds:
        return EventIds(conversation_id=self.prompt.conversation_id,
                        request_id=self.prompt.request_id, tenant=self.prompt.tenant)


# A turn the engine dies under, after it had its first output in this attempt, is left
# unended for its next owner to resume (``Interrupted``), in its first this many
# attempts; in a later one it fails with ``engine_dead``. A turn without output yet may
# be what killed the engine (its prefill): it fails. So a prompt that kills engines at
# its start kills one, and one that kills them later on, at most this many + 1 (each
# attempt writes its start, so the count is the log's, not this process's). A turn
# that reached the engine only after it had died (``EngineDead.before``) did not kill
# it: it is always left for the next owner.
RESUMED_ATTEMPTS = 2


def resumed_after_engine_death(streamed: bool, attempt: int, before: bool = False) -> bool:
    """Whether a turn the engine died under is left for its next owner to resume."""
    return before or (streamed and attempt < RESUMED_ATTEMPTS)


class Interrupted(Exception):
    """The engine died under a turn that had streamed in this attempt, or before the
    turn reached it: nothing ends it here, and the partition's next owner resumes it
    from what it wrote."""


class Runner:
    """Runs turns on ``engine``, and writes each turn's records to ``output``: its start
    and deltas as it runs, its end (``end``) once the worker has it.
    ``served(tenant, prompt_tokens, output_tokens)`` counts what a tenant had served
    (``workers.fairness``)."""

    def __init__(self, engine: Engine, output: Output, writer: TransactionalProducer,
                 histories: Histories, metrics: WorkerMetrics, worker: str,
                 served: Callable[..., None]) -> None:
        self.engine, self.output, self.writer = engine, output, writer
        self.histories, self.metrics = histories, metrics
        self.worker, self.served = worker, served

    async def run(self, turn: Turn) -> Final:
        """The turn's end: finished (stopped, at its length, or aborted), or failed.
        Raises CancelledError if the turn was abandoned (its partition moved, the worker
        stops): then nothing ends it here, and its next owner resumes it."""
        prompt = turn.prompt
        if turn.progress.preempted:
            log.debug("continuing %s at seq %d after giving its slot up", prompt.request_id,
                      len(turn.progress.parts), extra=turn_fields(prompt))
        elif turn.progress.attempt:
            self.metrics.resumed.inc()
            log.info("resuming %s at seq %d (attempt %d)", prompt.request_id,
                     len(turn.progress.parts), turn.progress.attempt, extra=turn_fields(prompt))
        span = self._trace_start(turn)
        try:
            final = await self._generate(turn, span)
        except asyncio.CancelledError:
            if span is not None:
                span.set_attribute("chat.abandoned", True)
                span.end()
            raise
        except (EngineRejected, HistoryUnavailable) as exc:
            final = self._failed(turn, exc.code, str(exc))
        except EngineDead as exc:
            if resumed_after_engine_death(turn.streamed, turn.progress.attempt, exc.before):
                if span is not None:
                    span.set_attribute("chat.interrupted", True)
                    span.end()
                self.metrics.interrupted.inc()
                log.warning("the engine died under %s: left for its next owner (%s)",
                            prompt.request_id, exc, extra=turn_fields(prompt))
                raise Interrupted(str(exc)) from exc
            final = self._failed(turn, "engine_dead", str(exc))
        except Exception as exc:
            log.exception("generation %s failed", prompt.request_id, extra=turn_fields(prompt))
            final = self._failed(turn, "internal_error", type(exc).__name__)
        if span is not None:
            span.set_attributes(_ended(final))
            span.end()
        return final

    def unstarted(self, turn: Turn) -> Final:
        """The end of a turn that must not start (cancelled, abandoned, its session
        deleted), with what earlier attempts wrote."""
        progress = turn.progress
        return GenerationFinished(
            **turn.ids, ref=turn.offset, model=self.engine.model_name,
            attempt=progress.attempt, reply_seq=turn.prompt.reply_seq, finish_reason="abort",
            text="".join(progress.parts), deltas=len(progress.parts),
            usage=Usage(prompt_tokens=0, completion_tokens=len(progress.token_ids)),
            duration_ms=0.0)

    async def _generate(self, turn: Turn, span: Span | None) -> Final:
        prompt, progress = turn.prompt, turn.progress
        model = self.engine.model_name
        if prompt.model != model:
            raise EngineRejected("model_not_served",
                                 f"This worker serves '{model}', not '{prompt.model}'.")
        taker = _Taker(self, turn)  # its clock starts before the history is read
        messages = await self.histories.input_for(prompt, turn.tp[1])
        turn.history = messages[:prompt.history_len]
        # The user's memories it recalled come first, outside the session.
        request = EngineRequest(prompt.request_id, recall(prompt.recalled) + messages,
                                prompt.sampling, tuple(progress.token_ids),
                                None if span is None else carrier_of(span))
        try:
            await self.engine.run(request, taker.take)
        except BaseException:
            taker.drop()  # what it holds is not written: a next attempt generates it again
            raise
        return taker.finished()
    def _failed(self, turn: Turn, code: str, message: str) -> GenerationFailed:
        return GenerationFailed(**turn.ids, ref=turn.offset,
                                attempt=turn.progress.attempt, code=code, message=message)

    async def end(self, turn: Turn, final: Final) -> Final:
        """Write the turn's end (its live entry and its durable event, in one transaction,
        as ``fits`` has it) and wait until that is committed; the end as written. Raises
        as ``TransactionalProducer.send`` does (``Fenced``: the partition moved on)."""
        final, value = self.fits(final, turn.seal)
        written = self.output.end(turn.tp[1], turn.offset, final,
                                  conversation_key(turn.prompt.conversation_id), value)
        self.output.gather_soon()
        await written
        return final

    def fits(self, final: Final, seal: SealWith) -> tuple[Final, bytes]:
        """``final`` and its record, or, if the log would not take it (a reply larger
        than its topic's records), a failure that says so and its record: the turn ends
        alone, never retried."""
        limit = self.writer.limit(GENERATIONS)
        value = self.output.encoded(final, seal)
        if len(value) <= limit - 1024:
            return final, value
        failed = GenerationFailed(
            conversation_id=final.conversation_id, request_id=final.request_id,
            tenant=final.tenant, ref=final.ref, attempt=final.attempt, code="reply_too_large",
            message=f"The reply ({len(value):,} bytes) is larger than the log takes "
                    f"({limit:,} bytes: PIPELINE_MAX_RECORD_BYTES).")
        return failed, self.output.encoded(failed, seal)

    def _trace_start(self, turn: Turn) -> Span | None:
        """The turn's ``chat.queue`` span (from the log's append until now, when the
        engine takes it) and its ``chat.engine`` span, begun (``pipeline.tracing``)."""
        if turn.traced is None:
            return None
        attributes: dict[str, str | int] = {
            "chat.request_id": turn.prompt.request_id, "chat.tenant": turn.prompt.tenant,
            "chat.model": self.engine.model_name, "chat.attempt": turn.progress.attempt,
            "messaging.kafka.offset": turn.offset, "chat.worker": self.worker}
        TRACER.start_span("chat.queue", context=turn.traced.parent, attributes=attributes,
                          start_time=ms_to_ns(turn.traced.appended_ms)).end()
        return TRACER.start_span("chat.engine", context=turn.traced.parent,
                                 attributes=attributes)


class _Taker:
    """What a turn does with each output the engine hands it (``take``, called from the
    engine's step loop, so it never waits): its start at the first, then its text held
    for its partition's open live record (``Output.hold``), which takes it as one delta
    when the record is made (``drain``): a turn's text in one record is one delta,
    however many engine steps made it, and ``seq`` stays gap-free. Called per sequence
    per engine step: it does no more there than hold the text, and what it uses each
    time is held in its own slots."""

    __slots__ = (
        "batch",
        "closed",
        "finish_reason",
        "held_ids",
        "held_text",
        "itl",
        "last_token",
        "output",
        "partition",
        "prompt_tokens",
        "ref",
        "runner",
        "served",
        "started",
        "tenant",
        "tokens",
        "ttft",
        "turn",
    )

    def __init__(self, runner: Runner, turn: Turn) -> None:
        self.runner, self.turn = runner, turn
        self.started = self.last_token = time.monotonic()
        self.ttft: float | None = None
        self.prompt_tokens = 0
        self.finish_reason: FinishReason = "abort"
        self.held_text: list[str] = []
        self.held_ids: list[int] = []
        self.batch: object = None  # the open record it is held for (``Output.hold``)
        self.closed = False
        self.output, self.served = runner.output, runner.served
        self.itl, self.tokens = runner.metrics.itl, runner.metrics.tokens
        self.partition, self.ref, self.tenant = turn.tp[1], turn.offset, turn.prompt.tenant

    def take(self, text: str, token_ids: tuple[int, ...], prompt_tokens: int,
             finish_reason: str | None) -> None:
        now = time.monotonic()
        if self.ttft is None:
            self._start(now, prompt_tokens)
        elif token_ids:
            self.itl.observe((now - self.last_token) / len(token_ids))
        self.last_token = now
        if text or token_ids:
            self.held_text.append(text)
            self.held_ids.extend(token_ids)
            self.output.hold(self.partition, self, 4 * len(text) + 8 * len(token_ids),
                             self.turn.epoch)
        if finish_reason is not None and finish_reason in ("stop", "length"):
            self.finish_reason = "stop" if finish_reason == "stop" else "length"

    def _start(self, now: float, prompt_tokens: int) -> None:
        runner, turn = self.runner, self.turn
        prompt, progress, partition, offset = turn.prompt, turn.progress, turn.tp[1], turn.offset
        self.ttft = now - self.started
        turn.streamed = True
        self.prompt_tokens = prompt_tokens
        runner.served(prompt.tenant, prompt_tokens=prompt_tokens)
        runner.metrics.ttft.observe(self.ttft)
        runner.output.start(partition, offset, GenerationStarted(
            **turn.ids, ref=offset, model=runner.engine.model_name, worker=runner.worker,
            attempt=progress.attempt, reply_seq=prompt.reply_seq,
            prompt_tokens=prompt_tokens), conversation_key(prompt.conversation_id),
            turn.epoch, turn.seal)
        for earlier in progress.republish:  # only the durable record had them
            runner.output.delta(partition, offset, earlier.seq, earlier.text,
                                earlier.token_ids, turn.epoch)

    def drain(self) -> tuple[int, str, tuple[int, ...]] | None:
        """What it holds as its next delta (``seq``, text, token ids), now counted as
        emitted; None if it holds nothing (or was dropped)."""
        if self.closed or not (self.held_text or self.held_ids):
            return None
        text, token_ids = "".join(self.held_text), tuple(self.held_ids)
        self.held_text.clear()
        self.held_ids.clear()
        progress = self.turn.progress
        seq = len(progress.parts)
        progress.parts.append(text)
        progress.token_ids.extend(token_ids)
        if token_ids:
            self.tokens.inc(len(token_ids))
            self.served(self.tenant, 0, len(token_ids))
        return seq, text, token_ids

    def drop(self) -> None:
        """The turn stopped before its end (cancelled, failed): what it holds is never
        written, and its record no longer takes anything of it."""
        self.closed = True
        self.held_text.clear()
        self.held_ids.clear()

    def finished(self) -> GenerationFinished:
        """The turn's end, once the engine handed its last output: what it still holds
        goes as its last delta, in the record its end goes in."""
        rest = self.drain()
        if rest is not None:
            self.output.delta(self.partition, self.ref, *rest, self.turn.epoch)
        self.closed = True
        turn, progress = self.turn, self.turn.progress
        prompt = turn.prompt
        return GenerationFinished(
            **turn.ids, ref=turn.offset, model=self.runner.engine.model_name,
            attempt=progress.attempt, reply_seq=prompt.reply_seq,
            finish_reason=self.finish_reason, text="".join(progress.parts),
            deltas=len(progress.parts),
            usage=Usage(prompt_tokens=self.prompt_tokens,
                        completion_tokens=len(progress.token_ids)),
            ttft_ms=None if self.ttft is None else self.ttft * 1000,
            duration_ms=(time.monotonic() - self.started) * 1000)


def _ended(final: Final) -> dict[str, str | int | float]:
    if isinstance(final, GenerationFailed):
        return {"chat.failure": final.code}
    return {"chat.finish_reason": final.finish_reason,
            "gen_ai.usage.input_tokens": final.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": final.usage.completion_tokens,
            "chat.ttft_ms": final.ttft_ms or 0.0}
