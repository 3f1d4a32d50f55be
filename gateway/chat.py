"""A chat turn: accept it durably, then follow its generation in the log.

A new turn's prompt carries its new messages and names the session's history
(``schemas.history``): by its last turn, or, when that turn cannot be placed in the log,
inline. A prompt the log cannot take, or a session the model's context cannot hold, is
refused alone, before anything is written.

A client follows a turn through a ``Following``: the turn's items already in the log
(read once, when it attaches late or resumes: ``chat.live``, and ``chat.generations``
for turns written before the live stream), then the live ones from the process's
fan-out. A finished turn whose live items are past the live stream's retention is sent
whole, from its end in the durable record. A stream that ends before its turn does
publishes ``ClientDetached``; the worker stops the turn after the grace period unless a
client attaches again (``ClientAttached``), through any gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime

from gateway.auth import Caller, Guard, estimate_tokens
from gateway.cursor import failure
from gateway.dependencies import KAFKA, from_log
from gateway.fleet import Fleet
from gateway.ids import EventPosition, completion_id, conversation_of, idempotent_conversation
from gateway.memory import MemoryClient
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ChatRequest
from gateway.problems import (
    CompletionNotFound,
    ContextTooLong,
    GenerationTimeout,
    InvalidLastEventId,
    LogUnavailable,
    ModelNotFound,
    ModelUnavailable,
    OverLimit,
    Problem,
    PromptTooLarge,
    SessionNotFound,
    StoreUnavailable,
    TenantLimit,
    TurnInProgress,
)
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.tail import Delivered, GenerationTail, Overflow, Subscription, legacy
from gateway.view import ConversationView, TurnState
from pipeline.codec import Position, conversation_key, encode, key_of
from pipeline.kafka import EventProducer, ProduceError, RecordTooLarge, TransactionalProducer
from pipeline.keystore import Keyring, KeyringError
from pipeline.logs import bind_turn
from pipeline.retry import Backoff
from pipeline.sealing import DEFLATE_UP_TO, DataKey
from pipeline.topics import CLOCK_SKEW_MS, CONTROL, ERASURES, GENERATIONS, KEYS, LIVE, PROMPTS
from schemas import (
    Charge,
    ChatMessage,
    ClientAttached,
    ClientDetached,
    FinishReason,
    GenerationCancelled,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    Recalled,
    SessionCreated,
    SessionDeleted,
    Usage,
)
from schemas.conversation import UNFINISHED
from schemas.history import digest
from schemas.history import recall as recall_messages
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
    ended: bool = False  # the client has had the turn's end


@dataclass(frozen=True)
class Reply:
    """A turn's whole reply, for a client that waits for all of it."""

    text: str
    finish_reason: FinishReason
    usage: Usage


class ChatService:
    def __init__(
        self, settings: GatewaySettings, producer: EventProducer,
        prompts: TransactionalProducer, tail: GenerationTail, store: ConversationStore,
        fleet: Fleet, guard: Guard, metrics: GatewayMetrics, configured_models: list[str],
        keyring: Keyring, memory: MemoryClient,
    ) -> None:
        self.settings = settings
        self.producer = producer  # control events: facts that may arrive late
        self.prompts = prompts  # turns: committed, or certainly never written
        self.tail = tail
        self.store = store
        self.fleet = fleet
        self.guard = guard
        self.metrics = metrics
        self.configured_models = configured_models
        self.keyring = keyring  # the conversations' data keys (pipeline.sealing)
        self.memory = memory  # users' memories, recalled into turns that ask
        self._open: Counter[uuid.UUID] = Counter()  # conversations with an open stream
        self._streams: Counter[str] = Counter()  # open streams per tenant

    @property
    def models(self) -> list[str]:
        """The models live workers serve; before any worker is up, the configured ones
        (requests for them wait in the log for a worker)."""
        return sorted(self.fleet.models | self.fleet.aliases) or self.configured_models

    def check_model(self, version: str) -> None:
        """A version live workers serve, or configured (``GATEWAY_MODELS``: its turns wait
        in the log for a worker); one served within the hour and not now is refused for
        now (503); any other does not exist (404)."""
        if version not in self.fleet.models and version not in self.configured_models:
            raise ModelUnavailable(version) if version in self.fleet.known \
                else ModelNotFound(version)

    def check_limits(self, request: ChatRequest) -> None:
        if len(request.messages) > self.settings.max_messages:
            raise OverLimit(f"At most {self.settings.max_messages} messages per request.",
                            "messages")
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is not None and max_tokens > self.settings.max_tokens_limit:
            raise OverLimit(f"max_tokens is at most {self.settings.max_tokens_limit}.",
                            "max_tokens")

    async def visible_view(self, conversation_id: uuid.UUID, tenant: str) -> ConversationView:
        view = await self.store.view(conversation_id)
        if not view.visible_to(tenant):
            raise SessionNotFound(conversation_id)
        return view

    # -- a new turn -------------------------------------------------------------
    async def accept(self, request: ChatRequest, session: uuid.UUID | None, caller: Caller,
                     idempotency_key: str | None,
                     trace: Sequence[tuple[str, bytes]] = ()) -> Following:
        """Write the turn's PromptSubmitted (with ``trace``, its trace context, in the
        record's headers); return once Kafka acknowledged it. With an idempotency key
        that was used before, follow the original turn instead."""
        self.check_limits(request)
        # The whole acceptance is bounded: past this, a prompt not yet asked to commit is
        # refused (503), and certainly never written.
        deadline = time.monotonic() + self.settings.accept_timeout_s
        tenant = caller.tenant
        key = idempotency_key
        # The key is kept as its keyed digest only (``pipeline.digests``).
        key_digest = self.keyring.digests.raw("idempotency", tenant, key) if key else None
        conversation = session or (idempotent_conversation(key_digest) if key_digest
                                   else uuid.uuid4())
        # An alias's turn goes to the version its rollout record picks (schemas.rollout).
        version, routed_by = self.fleet.route(request.model, conversation)
        self.check_model(version)
        request_id = completion_id(conversation, key_digest)
        bind_turn(request_id=request_id, conversation_id=conversation, tenant=tenant)
        history = []
        view: ConversationView | None = None
        if session is not None or key is not None:
            view = await self.store.view(conversation)
            turn = view.turns.get(request_id) if key is not None else None
            if turn is not None and view.visible_to(tenant):
                self.metrics.idempotent_replays.inc()
                return await self.attach_turn(view, turn, tenant, None)
            if session is not None:
                if not view.visible_to(tenant):
                    raise SessionNotFound(session)
                busy = view.busy()
                if busy is not None:
                    raise TurnInProgress(busy.request_id)
                history = view.history()
        self.fleet.admit(version, tenant)
        if request.stream:
            self.check_streams(tenant)
        new = tuple(m.to_event() for m in request.messages)
        max_tokens = request.sampling().max_tokens
        # Memory as the request says, else as its session was created.
        memory = request.memory if request.memory is not None else bool(
            view is not None and view.memory_user)
        user = request.user or (view.memory_user if view is not None else None)
        recalled = await self._recall(memory, user, tenant, new, session)
        before = list(recall_messages(recalled))  # what the model is given first
        self.check_context(version, before + history, new, max_tokens)
        estimate = estimate_tokens(sum(len(m.content) for m in (*before, *history, *new)),
                                   max_tokens)
        await self.guard.charge(caller, requests=0, tokens=estimate)
        # Trued up to the turn's usage when it ends (the projector): a turn without
        # max_tokens is charged a default now, and what it really used then. It also
        # names the turn's key, whose revocation stops it (``gateway.keys.stop_turns``).
        charge = (Charge(key_id=caller.key_id, tokens=estimate)
                  if caller.key_id is not None else None)
        # The history by reference (the session's last turn), or inline when that turn
        # cannot be placed in the log (stored before turns' ends were).
        previous = view.last_turn() if view is not None and history else None
        if view is not None and len(view.turns) % self.settings.history_inline_every == 0:
            previous = None  # whole, every so many turns: a rebuild reads that many at most
        prompt = PromptSubmitted(
            conversation_id=conversation, request_id=request_id, tenant=tenant,
            model=version, alias=routed_by.alias if routed_by else None,
            rollout=routed_by.id if routed_by else None, messages=new,
            history_len=len(history), previous=previous,
            history=tuple(history) if history and previous is None else None,
            history_digest=digest(history) if history else None,
            sampling=request.sampling(),
            idempotency_key=key_digest.hex()[:32] if key_digest else None,
            background=request.background,
            history_end=view.prompts_end if view is not None else None, charge=charge,
            memory=memory, user=user,
            recalled=recalled,
        )
        # Text past a MiB is sealed as it is (``pipeline.sealing``): a record at least
        # that long. One the log would refuse is refused before it costs a seal.
        text = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in new)
        if text > max(DEFLATE_UP_TO, self.prompts.limit(PROMPTS)):
            raise PromptTooLarge(text, self.prompts.topic_limit(PROMPTS))
        # Its content is sealed with the conversation's data key, durable before it.
        data_key = await self._key_for(conversation, tenant, request.user, view)
        value = encode(prompt, data_key)  # sealed once: each encoding draws a new nonce
        size = len(value) + len(str(conversation))  # its value and its key
        if size > self.prompts.limit(PROMPTS):
            raise PromptTooLarge(size, self.prompts.topic_limit(PROMPTS))
        # Follow before producing, so no event of this turn can pass unseen.
        partition = self.store.partition_of(conversation)
        sub = await self.tail.follow(request_id, conversation_key(conversation), partition)
        try:
            if KAFKA.open:  # refused at once, until a probe sees Kafka answer
                raise LogUnavailable(request_id)
            try:  # answered definitely: committed, or never to be written
                written = await self.prompts.send_raw(
                    PROMPTS, conversation_key(conversation), value, trace, deadline=deadline)
            except RecordTooLarge as exc:
                raise PromptTooLarge(exc.size, exc.limit) from exc
            except ProduceError as exc:
                log.warning("prompt %s not accepted: %s", request_id, exc)
                KAFKA.trip(exc)
                raise LogUnavailable(request_id) from exc
            ref = written.offset
            if view is not None:
                await self._judge(view, prompt, written.offset)
                # An idempotent retry racing its original runs as the original: its
                # prompt's offset is the turn's reference.
                ref = view.turns[request_id].prompt_offset or ref
            self.tail.bind(sub, ref)
        except BaseException:
            self.tail.unfollow(sub)
            raise
        self.metrics.accepted.inc()
        if routed_by is not None:
            self.metrics.routed.labels(routed_by.alias, version).inc()
        return Following(request_id, conversation, tenant, int(prompt.occurred_at.timestamp()),
                         prompt.model, sub, [], attachment=request_id,
                         accepted_at=time.monotonic())

    async def _recall(self, memory: bool, user: str | None, tenant: str,
                      new: tuple[ChatMessage, ...], session: uuid.UUID | None
                      ) -> tuple[Recalled, ...]:
        """The user's memories nearest the turn's last user message, if it has memory
        on (``MemoryUnavailable`` if they cannot be had: it is not run without)."""
        if not memory:
            return ()
        if user is None:
            raise OverLimit("memory needs a user: set the request's user field (the end "
                            "user whose memories these are).", "user")
        query = next((m.content for m in reversed(new) if m.role == "user"), "")
        started = time.perf_counter()
        recalled = await self.memory.recall(tenant, user, query, session)
        self.metrics.memory_recall.observe(time.perf_counter() - started)
        # A memory of a conversation erased a moment ago (before the memory service read
        # its deletion) is not carried into another.
        return tuple(r for r in recalled if not self._erased(r.id))

    def _erased(self, completion: str) -> bool:
        try:
            return self.keyring.revoked(conversation_of(completion))
        except Problem:
            return False

    def check_context(self, model: str, history: list[ChatMessage],
                      new: tuple[ChatMessage, ...], max_tokens: int | None) -> None:
        """Refuse (400 ``context_length_exceeded``) a turn that cannot fit the model's
        context whatever its tokens: its text needs at least as many tokens as it has
        bytes over the most bytes one token of the model's stands for (its workers say
        both). The worker's exact count decides every other case."""
        limits = self.fleet.limits(model)
        if limits is None:
            return
        context, token_bytes = limits
        text = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in (*history, *new))
        at_least = -(-text // (2 * token_bytes))  # halved again, to be certain
        if at_least + (max_tokens or 1) > context:
            raise ContextTooLong(
                f"This model's maximum context length is {context:,} tokens; the session's "
                f"{len(history)} messages and this request's {len(new)} need at least "
                f"{at_least:,} tokens (of {text:,} bytes), with "
                f"{'max_tokens ' + format(max_tokens, ',') if max_tokens else 'one'} more.")

    async def _judge(self, view: ConversationView, prompt: PromptSubmitted, offset: int) -> None:
        """Raise 409 if ``prompt``, now at ``offset``, is void: another turn of its session
        was accepted after its history was read (``schemas.conversation``). Every
        reader of the log reaches the same verdict, so a void prompt is never run."""
        assert view.prompts_end is not None
        backoff = Backoff(0.2, 2.0)
        while True:
            try:  # the turns appended between the history's read and this prompt
                await self.store.fold(view, PROMPTS, view.prompts_end, offset)
                break
            except LogUnavailable:
                # The prompt is committed: it runs unless void, so no refusal may be given
                # until the log says which. (A client that leaves meanwhile learns it by
                # retrying with its Idempotency-Key.)
                await asyncio.sleep(backoff.next())
        view.apply(prompt, offset)
        rival = view.void.get(prompt.request_id)
        if rival is not None:
            log.info("prompt %s is void: %s was accepted first in its session",
                     prompt.request_id, rival)
            raise TurnInProgress(rival)

    async def _key_for(self, conversation: uuid.UUID, tenant: str, user: str | None,
                       view: ConversationView | None) -> DataKey:
        """The conversation's data key (``pipeline.keystore``): the one this gateway holds,
        else the one the store names (one fetch), else a new one, durable in
        ``chat.keys`` before anything is sealed with it. A deleted conversation takes no
        more content (``SessionNotFound``)."""
        if view is not None and view.deleted:
            raise SessionNotFound(conversation)
        held = self.keyring.for_writing(conversation)
        if held == "erased":
            raise SessionNotFound(conversation)
        if isinstance(held, DataKey):
            return held
        for ref in view.key_refs if view is not None else ():
            try:
                found = await asyncio.to_thread(self.keyring.fetch, ref)
            except KeyringError as exc:
                raise LogUnavailable(str(conversation)) from exc
            if found is not None:
                return found
        new = self.keyring.new_key(conversation, tenant, user)
        written = await from_log(lambda: self.producer.send_raw(
            KEYS, new.record_key, new.value, partition=new.partition),
            self.settings.dependency_timeout_s)
        return self.keyring.placed(new, written.offset)

    # -- sessions -------------------------------------------------------------------
    async def create_session(self, tenant: str, title: str | None, user: str | None = None,
                             memory: bool = False) -> SessionCreated:
        """A new session, once its creation is in the log (with memory on for ``user``
        if ``memory``)."""
        event = SessionCreated(conversation_id=uuid.uuid4(),
                               request_id=f"session-{uuid.uuid4().hex}", tenant=tenant,
                               title=title, memory_user=user if memory else None)
        key = await self._key_for(event.conversation_id, tenant, user, None)
        await from_log(lambda: self.producer.send_raw(CONTROL, key_of(event),
                                                      encode(event, key)),
                       self.settings.dependency_timeout_s)
        return event

    async def delete_session(self, session: uuid.UUID, tenant: str) -> None:
        """Delete a session the tenant sees (``SessionNotFound`` otherwise), once the
        deletion is in the log: its running turns stop, the store drops it, and its data
        keys are destroyed, so its content is unreadable in the log too."""
        view = await self.visible_view(session, tenant)
        await from_log(lambda: self.producer.send(CONTROL, SessionDeleted(
            conversation_id=session, request_id=f"delete-{uuid.uuid4().hex}",
            tenant=tenant, reason="deleted")), self.settings.dependency_timeout_s)
        # Its erasure (every keyring refuses its keys from then on), then the tombstones
        # of the keys the store knows: the broker deletes their records within the
        # erasure window. The deletion is durable already: if Kafka fails these, the
        # projector destroys the keys when it reads it (``projections.projector``).
        timeout_s = self.settings.dependency_timeout_s
        try:
            await from_log(functools.partial(self.producer.send_raw, ERASURES,
                                             *self.keyring.erasure(session, tenant)),
                           timeout_s)
            for ref in view.key_refs:
                key, partition = self.keyring.tombstone(session, ref)
                await from_log(functools.partial(self.producer.send_raw, KEYS, key, None,
                                                 partition=partition), timeout_s)
        except LogUnavailable as exc:
            log.warning("session %s deleted; its keys are left to the projector: %r",
                        session, exc)

    # -- an existing turn ---------------------------------------------------------
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
                                     turn.prompt_offset)
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
                conversation, turn, sub, spans, resume)
            if gone or (resume is not None and not any(d.key == resume for d in history)):
                if held:  # the log holds that position, and it is another turn's
                    raise InvalidLastEventId()
                # A position the log does not hold (past the live stream's retention):
                # the turn's end at once if it has one, else 400.
                history, resume = await self._end_only(turn, partition), None
            elif resume is None and turn.status not in UNFINISHED and not any(
                    isinstance(d.item, TERMINAL) for d in history):
                history = await self._whole(turn, partition)  # its live items are gone
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

    async def _read_turn(self, conversation: uuid.UUID, turn: TurnState, sub: Subscription,
                         spans: dict[str, tuple[int, int]],
                         resume: tuple[str, int, int] | None
                         ) -> tuple[list[Delivered], bool]:
        """The turn's items in its ``spans`` (from the resume position in its topic), and
        whether the log held a record at the resume position."""
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
            if isinstance(event, GenerationEvent) and event.request_id == turn.request_id \
                    and (d := legacy(r, event)) is not None:
                items.append(d)
        ref = sub.ref
        for record, batch in await self.store.live(partition, starts[LIVE], spans[LIVE][1]):
            held = held or (resume is not None and resume[:2] == (LIVE, record.position.offset))
            for index, entry_ref, item in entries(batch):
                if ref is None and isinstance(item, Start) and \
                        item.request_id == turn.request_id:
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
        ``GenerationTimeout``."""
        for item in f.history:
            yield item
        deadline = f.sub.deadline = time.monotonic() + self.settings.generation_timeout_s
        while True:
            live = await f.sub.get()
            if live is None and time.monotonic() >= deadline:
                raise GenerationTimeout()
            yield live

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
            self._open[f.conversation_id] -= 1
            if self._open[f.conversation_id] <= 0:
                del self._open[f.conversation_id]
            self._streams[f.tenant] -= 1
            if self._streams[f.tenant] <= 0:
                del self._streams[f.tenant]
            self.metrics.active_sessions.set(len(self._open))
            self.tail.unfollow(f.sub)
            if not f.ended:
                self._detach(f)

    async def _observed(self, f: Following) -> AsyncIterator[Delivered | None]:
        async for item in self._events(f):
            if item is not None:
                self._observe(f, item)
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
