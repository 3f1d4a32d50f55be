"""Following a turn: a client attached to it (at its acceptance, or later, to resume),
its items read from the log once, then the live ones, until its end (``Follow``).

A client follows a turn through a ``Following``: the turn's items already in the log
(read once, when it attaches late or resumes: ``chat.live``, and ``chat.generations``
for turns written before the live stream), then the live ones from the process's
fan-out (``gateway.tail``). A finished turn whose live items are past the live stream's
retention is sent whole, from its end in the durable record. A stream that ends before
its turn does publishes ``ClientDetached``; the worker stops the turn after the grace
period unless a client attaches again (``ClientAttached``), through any gateway.

The stages, as vLLM's output side has them: attach (``attach``, ``attach_turn``: the
turn's span in the log, its items there) → follow (``following``, ``collect``: the
items as they come, counted) → detach (a client gone before the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

from gateway.cursor import Seqs, failure, next_seq
from gateway.dependencies import from_log
from gateway.ids import EventPosition, conversation_of
from gateway.metrics import GatewayMetrics
from gateway.problems import (
    CompletionNotFound,
    GenerationTimeout,
    InvalidLastEventId,
    LogUnavailable,
    Problem,
    StoreUnavailable,
    TenantLimit,
)
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.subscription import Delivered, Overflow, Subscription, legacy, release
from gateway.tail import GenerationTail
from gateway.view import ConversationView, TurnState
from pipeline.codec import Position, conversation_key
from pipeline.kafka import EventProducer
from pipeline.logs import bind_turn
from pipeline.retry import Backoff
from pipeline.topics import CLOCK_SKEW_MS, CONTROL, GENERATIONS, LIVE
from schemas import (
    ClientAttached,
    ClientDetached,
    FinishReason,
    GenerationCancelled,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    Usage,
)
from schemas.conversation import UNFINISHED
from schemas.live import TERMINAL, Delta, End, Failure, Start, StreamItem, entries

log = logging.getLogger(__name__)
# A turn's live records and its start and end events are stamped by one worker's clock,
# moments apart: its span in the log runs from this long before its start to this long
# after its end.
WORKER_MARGIN_MS = 2_000


@dataclass
class Following:
    """One client following one turn."""

    completion_id: str
    conversation_id: uuid.UUID
    tenant: str
    created: int
    model: str
    sub: Subscription
    history: list[Delivered]
    attachment: str
    resume_after: tuple[str, int, int] | None = None
    accepted_at: float = 0.0
    ended: bool = False  # the turn's end went to the client (set by ``Follow`` only)


@dataclass(frozen=True)
class Reply:
    """A turn's whole reply, for a client that waits for all of it."""

    text: str
    finish_reason: FinishReason
    usage: Usage


class Follow:
    """Clients following turns: ``producer`` writes their control events (attached,
    detached, cancelled); ``tail`` is the process's fan-out of the live stream;
    ``store`` finds turns and reads the log."""

    def __init__(self, settings: GatewaySettings, producer: EventProducer,
                 tail: GenerationTail, store: ConversationStore,
                 metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.producer = producer
        self.tail = tail
        self.store = store
        self.metrics = metrics
        self._open: Counter[uuid.UUID] = Counter()  # conversations with an open stream
        self._streams: Counter[str] = Counter()  # open streams per tenant

    # -- a turn being accepted (``gateway.accept``) -----------------------------------
    async def watch(self, request_id: str, conversation: uuid.UUID) -> Subscription:
        """Follow a turn about to be written, so that no event of it passes unseen; it is
        ``accepted`` once written, or ``unfollow``-ed."""
        return await self.tail.follow(request_id, conversation_key(conversation),
                                      self.store.partition_of(conversation))

    def written(self, sub: Subscription, ref: int) -> None:
        """The turn ``sub`` follows was written with reference ``ref`` (its prompt's
        offset): told at once, before anything else is awaited, as its worker may end it
        any moment now."""
        self.tail.bind(sub, ref)

    def accepted(self, sub: Subscription, prompt: PromptSubmitted) -> Following:
        """The client's following of the turn ``prompt`` (``written``) began."""
        return Following(prompt.request_id, prompt.conversation_id, prompt.tenant,
                         int(prompt.occurred_at.timestamp()), prompt.model, sub, [],
                         attachment=prompt.request_id, accepted_at=time.monotonic())

    def unfollow(self, sub: Subscription) -> None:
        self.tail.unfollow(sub)

    # -- attaching ----------------------------------------------------------------
    async def find_turn(self, completion: str,
                        tenant: str) -> tuple[ConversationView, TurnState]:
        bind_turn(request_id=completion, tenant=tenant)
        view = await self.store.view(conversation_of(completion))
        turn = view.turns.get(completion)
        if turn is None or not view.visible_to(tenant):
            raise CompletionNotFound(completion)
        bind_turn(conversation_id=view.id)
        return view, turn

    def check_streams(self, tenant: str) -> None:
        """Refuse (``TenantLimit``) another stream of a tenant with as many open here as
        its cap allows."""
        cap, count = self.settings.max_streams_per_tenant, self._streams[tenant]
        if count >= cap:
            raise TenantLimit("open streams", count, cap, "GATEWAY_MAX_STREAMS_PER_TENANT")

    async def attach(self, completion: str, tenant: str,
                     last_event_id: EventPosition | None, stream: bool = False) -> Following:
        """Follow a running or finished turn, after ``last_event_id`` if given (as a
        ``stream``: within the tenant's cap on open streams)."""
        if stream:
            self.check_streams(tenant)
        view, turn = await self.find_turn(completion, tenant)
        return await self.attach_turn(view, turn, tenant, last_event_id)

    async def attach_turn(self, view: ConversationView, turn: TurnState, tenant: str,
                          last_event_id: EventPosition | None) -> Following:
        """Follow ``turn``, after ``last_event_id`` if given. What is read of the log is
        the turn's own span (``_span``), whatever the client says: a position after it is
        refused without reading, one before it is read from the turn's start."""
        conversation = uuid.UUID(str(view.id))
        partition = self.store.partition_of(conversation)
        if last_event_id is not None and last_event_id[0] != partition:
            raise InvalidLastEventId()
        resume = None if last_event_id is None else (
            (GENERATIONS if last_event_id[2] is None else LIVE), last_event_id[1],
            last_event_id[2] or 0)
        sub = await self.tail.follow(turn.request_id, conversation_key(conversation), partition,
                                     turn.prompt_offset, held=True)
        try:
            spans = await self._span(turn, partition, sub)
            gone = False
            if resume is not None:
                start, end = spans[resume[0]]
                if resume[1] >= end:  # after the turn, or past the log's end
                    raise InvalidLastEventId()
                if resume[1] < start:  # before the turn, or past the stream's retention
                    gone = resume[1] < await self.store.start_of(resume[0], partition)
                    resume = None
            history, held = ([], False) if gone else await self._read_turn(
                conversation, turn.request_id, sub, spans, resume)
            if gone or (resume is not None and not any(d.key == resume for d in history)):
                if held:  # the log holds that position, and it is another turn's
                    raise InvalidLastEventId()
                # A position the log does not hold (past the live stream's retention):
                # the turn's end at once if it has one, else 400.
                history, resume = await self._end_only(turn, partition), None
            elif resume is None and turn.status not in UNFINISHED and not any(
                    isinstance(d.item, TERMINAL) for d in history):
                history = await self._whole(turn, partition)  # its live items are gone
            sub.hand_off(next_seq(history))
            attachment = uuid.uuid4().hex
            ended = any(isinstance(d.item, TERMINAL) for d in history)
            if not ended:
                await from_log(lambda: self.producer.send(CONTROL, ClientAttached(
                    conversation_id=conversation, request_id=turn.request_id, tenant=tenant,
                    attachment=attachment)), self.settings.dependency_timeout_s)
        except BaseException:
            self.tail.unfollow(sub)
            raise
        created = int(turn.submitted_at.timestamp()) if turn.submitted_at else 0
        return Following(turn.request_id, conversation, tenant, created, turn.model or "",
                         sub, history, attachment, resume)

    async def _span(self, turn: TurnState, partition: int,
                    sub: Subscription) -> dict[str, tuple[int, int]]:
        """Where the turn's records lie in each topic it is read from: from shortly before
        its first attempt started (its records and its start are stamped by one worker's
        clock) or, not started yet, before its prompt (the gateway's clock, which may
        differ from a worker's by ``CLOCK_SKEW_MS``); to shortly after its end, or to
        where ``sub`` reads on from (a turn not ended yet)."""
        ended = _ms(turn.ended_at) if turn.ended_at is not None \
            and turn.status not in UNFINISHED else None
        if turn.started_at is not None:
            since = _ms(turn.started_at) - WORKER_MARGIN_MS
        elif turn.submitted_at is not None:
            since = _ms(turn.submitted_at) - CLOCK_SKEW_MS
        else:  # neither is known: no longer ago than the longest turn
            since = (ended or int(time.time() * 1000)) - CLOCK_SKEW_MS - int(
                self.settings.generation_timeout_s * 1000)
        spans = {}
        for topic in (GENERATIONS, LIVE):
            end = sub.starts[topic]
            if ended is not None:
                end = min(end, await self.store.offset_at(topic, partition,
                                                          ended + WORKER_MARGIN_MS))
            start = await self.store.offset_at(topic, partition, since)
            spans[topic] = (min(start, end), end)
        return spans

    async def _read_turn(self, conversation: uuid.UUID, request_id: str, sub: Subscription,
                         spans: dict[str, tuple[int, int]],
                         resume: tuple[str, int, int] | None
                         ) -> tuple[list[Delivered], bool]:
        """The items of turn ``request_id`` in its ``spans`` (from the resume position in
        its topic), and whether the log held a record at the resume position."""
        partition = sub.partition
        starts = {topic: resume[1] if resume is not None and resume[0] == topic else start
                  for topic, (start, _) in spans.items()}
        held = False
        items = []
        for r, event in await self.store.events(GENERATIONS, conversation,
                                                starts[GENERATIONS], spans[GENERATIONS][1],
                                                keyed=False):
            held = held or (resume is not None and resume[:2] == (GENERATIONS,
                                                                  r.position.offset))
            if isinstance(event, GenerationEvent) and event.request_id == request_id \
                    and (d := legacy(r, event)) is not None:
                items.append(d)
        ref = sub.ref
        for record, batch in await self.store.live(partition, starts[LIVE], spans[LIVE][1]):
            held = held or (resume is not None and resume[:2] == (LIVE, record.position.offset))
            for index, entry_ref, item in entries(batch):
                if ref is None and isinstance(item, Start) and item.request_id == request_id:
                    ref = entry_ref
                    self.tail.bind(sub, ref)
                if entry_ref == ref:
                    items.append(Delivered(record.position, item, index))
        return items, held

    async def _durable_end(self, turn: TurnState,
                           partition: int) -> GenerationFinished | GenerationFailed | None:
        if turn.end_offset is None:
            return None
        event = await self.store.event_at(GENERATIONS, partition, turn.end_offset)
        if isinstance(event, (GenerationFinished, GenerationFailed)) and \
                event.request_id == turn.request_id:
            return event
        return None

    async def _end_only(self, turn: TurnState, partition: int) -> list[Delivered]:
        """A resume past what the stream holds: the turn's end, if it has ended."""
        end = await self._durable_end(turn, partition) \
            if turn.status not in UNFINISHED else None
        if end is None:
            raise InvalidLastEventId()
        item: StreamItem = End(end.deltas, end.finish_reason, end.usage) \
            if isinstance(end, GenerationFinished) else Failure(end.code, end.message)
        return [Delivered(None, Start(end.attempt, turn.request_id)), Delivered(None, item)]

    async def _whole(self, turn: TurnState, partition: int) -> list[Delivered]:
        """A finished turn whose live items are gone, from its end in the durable record."""
        end = await self._durable_end(turn, partition)
        if end is None:
            return []
        if isinstance(end, GenerationFailed):
            return [Delivered(None, Failure(end.code, end.message))]
        return [Delivered(None, Start(0, turn.request_id)), Delivered(None, Delta(0, end.text)),
                Delivered(None, End(1, end.finish_reason, end.usage))]

    async def cancel(self, completion: str, tenant: str) -> str:
        """Ask the worker to stop a turn now; return the turn's status before that."""
        view, turn = await self.find_turn(completion, tenant)
        if turn.status in ("pending", "running"):
            await from_log(lambda: self.producer.send(CONTROL, GenerationCancelled(
                conversation_id=uuid.UUID(str(view.id)), request_id=completion, tenant=tenant,
                reason="client request")), self.settings.dependency_timeout_s)
        return turn.status

    # -- following ----------------------------------------------------------------
    async def _events(self, f: Following) -> AsyncIterator[Delivered | None]:
        """The turn's events: those read from the log, then the live ones; None when a
        keep-alive is due (nothing came for a while). Past ``generation_timeout_s``,
        ``GenerationTimeout``. A live item past a gap (a delta, or the end, after seqs
        this client never got) is not sent on: what follows its last item is read again
        from the log (``_refill``), once per gap, and a gap the log has too is logged."""
        seqs = Seqs(f.resume_after)
        for item in f.history:
            seqs.passed(item)
            yield item
        deadline = f.sub.deadline = time.monotonic() + self.settings.generation_timeout_s
        refilled_at = -1
        while True:
            live = await f.sub.get()
            if live is None:
                if time.monotonic() >= deadline:
                    raise GenerationTimeout()
                yield None
                continue
            if seqs.missed(live) and seqs.next != refilled_at:
                refilled_at = seqs.next
                refill = await self._refill(f, deadline, seqs.next)
                if refill is not None:
                    for item in refill:
                        if seqs.after_gap(item):
                            self._pass(f, seqs, item)
                            yield item
                    continue
            self._pass(f, seqs, live)
            yield live

    def _pass(self, f: Following, seqs: Seqs, item: Delivered) -> None:
        """``item`` goes to the client; with a gap before it, which is said."""
        if seqs.missed(item):
            self.metrics.stream_gaps.inc()
            log.error("gap in %s: expected seq %d, got %s", f.completion_id, seqs.next,
                      item.item)
        seqs.passed(item)

    async def _refill(self, f: Following, deadline: float,
                      had: int) -> list[Delivered] | None:
        """The turn's items in the log, read again, and ``f`` moved to a new subscription
        that reads on from where that read ends (its client had deltas up to ``had``);
        None if the log could not be read (the client's stream goes on as it was)."""
        old = f.sub
        self.metrics.stream_refills.inc()
        log.warning("the live items of %s came with a gap: reading the turn again from the "
                    "log", f.completion_id)
        try:
            sub = await self.tail.follow(f.completion_id, old.key, old.partition, old.ref,
                                         held=True)
        except Problem as exc:
            log.warning("could not read %s again: %s", f.completion_id, exc)
            return None
        # From its submission (the gateway's clock), or no longer ago than the longest
        # turn where that is not known, as ``_span`` reads a turn not started yet.
        since = (f.created - 1) * 1000 if f.created else int(
            (time.time() - self.settings.generation_timeout_s) * 1000)
        try:
            spans = {topic: (min(await self.store.offset_at(
                topic, old.partition, since - CLOCK_SKEW_MS), end), end)
                for topic, end in sub.starts.items()}
            history, _ = await self._read_turn(f.conversation_id, f.completion_id, sub,
                                               spans, None)
        except Problem as exc:
            self.tail.unfollow(sub)
            log.warning("could not read %s again: %s", f.completion_id, exc)
            return None
        except BaseException:
            self.tail.unfollow(sub)
            raise
        sub.hand_off(max(had, next_seq(history)))
        self.tail.unfollow(old)
        sub.deadline = deadline
        f.sub = sub
        return history

    def _observe(self, f: Following, delivered: Delivered) -> None:
        """The gateway's metrics for a turn's item (per delta: a counter only)."""
        item = delivered.item
        if isinstance(item, Delta):
            self.metrics.streamed_tokens.inc(len(item.token_ids) or 1)
        elif isinstance(item, Start) and item.attempt == 0 and f.accepted_at:
            self.metrics.ttft.observe(time.monotonic() - f.accepted_at)
        elif isinstance(item, End) and f.accepted_at:
            self.metrics.latency.observe(time.monotonic() - f.accepted_at)

    @contextlib.asynccontextmanager
    async def following(self, f: Following) -> AsyncIterator[AsyncIterator[Delivered | None]]:
        """The turn's items while a client follows it (None: a keep-alive is due), each
        counted in the gateway's metrics. On leaving, the subscription ends; a client
        that left before the turn's end (``f.ended`` unset) is said to have detached,
        so that the worker's grace for the turn begins."""
        self.metrics.active_streams.inc()
        self._open[f.conversation_id] += 1
        self._streams[f.tenant] += 1
        self.metrics.active_sessions.set(len(self._open))
        try:
            yield self._observed(f)
        finally:
            self.metrics.active_streams.dec()
            release(self._open, f.conversation_id)
            release(self._streams, f.tenant)
            self.metrics.active_sessions.set(len(self._open))
            self.tail.unfollow(f.sub)
            if not f.ended:
                self._detach(f)

    async def _observed(self, f: Following) -> AsyncIterator[Delivered | None]:
        async for item in self._events(f):
            if item is not None:
                self._observe(f, item)
                if isinstance(item.item, TERMINAL):
                    f.ended = True  # the client is not detached from an ended turn
            yield item

    async def collect(self, f: Following) -> Reply:
        """Wait for the whole reply (non-streaming). The answer's status is written only
        then, so after acceptance it is never a refusal: a reader that fell behind reads
        the turn again from the log, and a turn past ``generation_timeout_s`` is
        cancelled before the 504 goes out."""
        while True:
            try:
                return await self._collect(f)
            except Overflow:  # only a reader stalled for a very long time gets here
                log.warning("collecting %s again from the log", f.completion_id)
                f = await self._reattach(f)
            except GenerationTimeout:
                try:
                    await self.cancel(f.completion_id, f.tenant)
                except Problem as exc:  # the answer stays the 504
                    log.warning("could not cancel %s: %s", f.completion_id, exc)
                raise

    async def _reattach(self, f: Following) -> Following:
        backoff = Backoff(0.2, 2.0)
        while True:
            try:
                return await self.attach(f.completion_id, f.tenant, None)
            except (LogUnavailable, StoreUnavailable):
                await asyncio.sleep(backoff.next())

    async def _collect(self, f: Following) -> Reply:
        parts: list[str] = []
        next_seq = 0
        try:
            async for delivered in self._events(f):
                if delivered is None:
                    continue  # a keep-alive: nothing to send a client that waits for all
                self._observe(f, delivered)
                item = delivered.item
                if isinstance(item, Delta):
                    if item.seq >= next_seq:  # else a copy of what is in already
                        parts.append(item.text)
                        next_seq = item.seq + delivered.span
                elif isinstance(item, End):
                    return Reply("".join(parts), item.finish_reason, item.usage)
                elif isinstance(item, Failure):
                    raise failure(item)
        finally:
            self.tail.unfollow(f.sub)
        raise AssertionError("unreachable")

    def _detach(self, f: Following) -> None:
        event = ClientDetached(conversation_id=f.conversation_id, request_id=f.completion_id,
                               tenant=f.tenant, attachment=f.attachment,
                               grace_s=self.settings.cancel_grace_s)
        self.producer.send(CONTROL, event).add_done_callback(_log_failure)

def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _log_failure(future: asyncio.Future[Position]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not publish that a client went away: %s", future.exception())
