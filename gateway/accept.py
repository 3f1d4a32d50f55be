"""A new turn, accepted durably (``Accept``): its prompt is committed to the log, or
certainly never written, before the client has an answer.

A new turn's prompt carries its new messages and names the session's history
(``schemas.history``): by its last turn, or, when that turn cannot be placed in the log,
inline. A prompt the log cannot take, or a session the model's context cannot hold, is
refused alone, before anything is written.

Three stages, as vLLM's input processor hands a request to its core:

1. **admit** (``_name``, ``_admit``): the request's limits, the version that serves
   it, its id and deadline, the session (or the original turn of a retried idempotency
   key, followed instead), the tenant's caps;
2. **build** (``_build``): the history, the memories recalled, the context's bound, the
   charge, the prompt;
3. **commit** (``_seal``, ``_commit``): the data key, the sealed record and its size,
   the following begun, the record produced in a transaction, the turn's reference
   bound at once (its worker may end it any moment), its verdict in its session.

Everything before the record is produced is held to the acceptance's deadline
(``_before_commit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.admission import Admission
from gateway.auth import Caller, estimate_tokens
from gateway.conversation_keys import ConversationKeys
from gateway.dependencies import KAFKA
from gateway.follow import Follow, Following
from gateway.ids import completion_id, idempotent_conversation
from gateway.memory import MemoryClient
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ChatRequest
from gateway.problems import (
    LogUnavailable,
    NotAcceptedInTime,
    OverLimit,
    PromptTooLarge,
    SessionNotFound,
    TurnInProgress,
)
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.subscription import Subscription
from gateway.view import ConversationView
from pipeline.codec import conversation_key
from pipeline.kafka import ProduceError, RecordTooLarge, TransactionalProducer
from pipeline.logs import bind_turn
from pipeline.retry import Backoff
from pipeline.sealing import DEFLATE_UP_TO
from pipeline.topics import PROMPTS
from schemas import Charge, ChatMessage, PromptSubmitted, Recalled
from schemas.history import digest
from schemas.history import recall as recall_messages
from schemas.rollout import Rollout

log = logging.getLogger(__name__)


@dataclass
class Admitted:
    """A turn admitted: where it goes, and the session it continues (if any)."""

    conversation: uuid.UUID
    request_id: str
    tenant: str
    version: str
    routed_by: Rollout | None
    deadline: float  # time.monotonic(): a prompt not asked to commit by then is refused
    key_digest: bytes | None = None  # its idempotency key's
    view: ConversationView | None = None  # its session, as read
    history: list[ChatMessage] = field(default_factory=list)


class Accept:
    """``prompts`` writes the turns, each in a transaction; ``follow`` follows them;
    ``store`` reads sessions; ``keys`` seals them; ``memory`` recalls the users'
    memories into turns that ask."""

    def __init__(self, settings: GatewaySettings, prompts: TransactionalProducer,
                 store: ConversationStore, follow: Follow, admission: Admission,
                 metrics: GatewayMetrics, keys: ConversationKeys,
                 memory: MemoryClient) -> None:
        self.settings = settings
        self.prompts = prompts  # turns: committed, or certainly never written
        self.store = store
        self.follow = follow
        self.admission = admission
        self.metrics = metrics
        self.keys = keys
        self.memory = memory

    async def accept(self, request: ChatRequest, session: uuid.UUID | None, caller: Caller,
                     idempotency_key: str | None,
                     trace: Sequence[tuple[str, bytes]] = ()) -> Following:
        """Write the turn's PromptSubmitted (with ``trace``, its trace context, in the
        record's headers); return once Kafka acknowledged it. With an idempotency key
        that was used before, follow the original turn instead."""
        self.admission.check_limits(request)
        admitted = self._name(request, session, caller.tenant, idempotency_key)
        async with self._before_commit(admitted):
            replayed = await self._admit(admitted, request, session, idempotency_key)
            if replayed is not None:
                return replayed
            prompt = await self._build(admitted, request, caller, session)
            value = await self._seal(admitted, prompt, request.user)
            # Follow before producing, so no event of this turn can pass unseen.
            sub = await self.follow.watch(prompt.request_id, admitted.conversation)
        return await self._commit(admitted, prompt, value, sub, trace)

    @contextlib.asynccontextmanager
    async def _before_commit(self, admitted: Admitted) -> AsyncIterator[None]:
        """Every step before the commit, within the acceptance's deadline, whatever each
        waits on (the store, the log, a key, memory): past it the turn is refused (503),
        and certainly never written. A commit once asked waits for the broker's answer.
        A refusal for the log names the turn (``X-Request-Id``), whichever step met it."""
        try:
            async with asyncio.timeout(admitted.deadline - time.monotonic()) as bound:
                yield
        except TimeoutError:
            if not bound.expired():
                raise
            self.metrics.accept_timeouts.inc()
            raise NotAcceptedInTime(admitted.request_id,
                                    self.settings.accept_timeout_s) from None
        except LogUnavailable as exc:  # refused, and named: a retry may name it too
            if exc.request_id == admitted.request_id:
                raise
            raise LogUnavailable(admitted.request_id) from exc

    # -- 1. admit -------------------------------------------------------------------
    def _name(self, request: ChatRequest, session: uuid.UUID | None, tenant: str,
              key: str | None) -> Admitted:
        """The turn's conversation, id, version and deadline."""
        # The whole acceptance is bounded: past this, a prompt not yet asked to commit is
        # refused (503), and certainly never written.
        deadline = time.monotonic() + self.settings.accept_timeout_s
        key_digest = self.keys.idempotency_digest(tenant, key) if key else None
        conversation = session or (idempotent_conversation(key_digest) if key_digest
                                   else uuid.uuid4())
        version, routed_by = self.admission.route(request.model, conversation)
        request_id = completion_id(conversation, key_digest)
        bind_turn(request_id=request_id, conversation_id=conversation, tenant=tenant)
        return Admitted(conversation, request_id, tenant, version, routed_by, deadline,
                        key_digest)

    async def _admit(self, admitted: Admitted, request: ChatRequest,
                     session: uuid.UUID | None, key: str | None) -> Following | None:
        """Admit the turn (None), or follow the original turn of a retried key."""
        tenant, request_id = admitted.tenant, admitted.request_id
        if session is not None or key is not None:
            view = admitted.view = await self.store.view(admitted.conversation)
            turn = view.turns.get(request_id) if key is not None else None
            if turn is not None and view.visible_to(tenant):
                self.metrics.idempotent_replays.inc()
                return await self.follow.attach_turn(view, turn, tenant, None)
            if session is not None:
                if not view.visible_to(tenant):
                    raise SessionNotFound(session)
                busy = view.busy()
                if busy is not None:
                    raise TurnInProgress(busy.request_id)
                admitted.history = view.history()
        self.admission.admit(admitted.version, tenant, request.stream)
        return None

    # -- 2. build -------------------------------------------------------------------
    async def _build(self, admitted: Admitted, request: ChatRequest, caller: Caller,
                     session: uuid.UUID | None) -> PromptSubmitted:
        view, history, tenant = admitted.view, admitted.history, admitted.tenant
        new = tuple(m.to_event() for m in request.messages)
        max_tokens = request.sampling().max_tokens
        # Memory as the request says, else as its session was created.
        memory = request.memory if request.memory is not None else bool(
            view is not None and view.memory_user)
        user = request.user or (view.memory_user if view is not None else None)
        recalled = await self._recall(memory, user, tenant, new, session)
        before = list(recall_messages(recalled))  # what the model is given first
        self.admission.check_context(admitted.version, before + history, new, max_tokens)
        estimate = estimate_tokens(sum(len(m.content) for m in (*before, *history, *new)),
                                   max_tokens)
        await self.admission.charge(caller, estimate)
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
        routed_by, key_digest = admitted.routed_by, admitted.key_digest
        return PromptSubmitted(
            conversation_id=admitted.conversation, request_id=admitted.request_id,
            tenant=tenant, model=admitted.version,
            alias=routed_by.alias if routed_by else None,
            rollout=routed_by.id if routed_by else None, messages=new,
            history_len=len(history), previous=previous,
            history=tuple(history) if history and previous is None else None,
            history_digest=digest(history) if history else None,
            sampling=request.sampling(),
            idempotency_key=key_digest.hex()[:32] if key_digest else None,
            background=request.background,
            history_end=view.prompts_end if view is not None else None, charge=charge,
            memory=memory, user=user, recalled=recalled,
        )

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
        return tuple(r for r in recalled if not self.keys.erased(r.id))

    # -- 3. commit ------------------------------------------------------------------
    async def _seal(self, admitted: Admitted, prompt: PromptSubmitted,
                    end_user: str | None) -> bytes:
        """The prompt's record value, sealed with its conversation's data key."""
        # Text past a MiB is sealed as it is (``pipeline.sealing``): a record at least
        # that long. One the log would refuse is refused before it costs a seal.
        text = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in prompt.messages)
        if text > max(DEFLATE_UP_TO, self.prompts.limit(PROMPTS)):
            raise PromptTooLarge(text, self.prompts.topic_limit(PROMPTS))
        # Its content is sealed with the conversation's data key, durable before it.
        data_key = await self.keys.for_content(admitted.conversation, admitted.tenant,
                                               end_user, admitted.view)
        # Sealed once: each encoding draws a new nonce.
        value = self.keys.codec.encode(prompt, data_key)
        size = len(value) + len(str(admitted.conversation))  # its value and its key
        if size > self.prompts.limit(PROMPTS):
            raise PromptTooLarge(size, self.prompts.topic_limit(PROMPTS))
        return value

    async def _commit(self, admitted: Admitted, prompt: PromptSubmitted, value: bytes,
                      sub: Subscription, trace: Sequence[tuple[str, bytes]]) -> Following:
        conversation, view = admitted.conversation, admitted.view
        try:
            if KAFKA.open:  # refused at once, until a probe sees Kafka answer
                raise LogUnavailable(prompt.request_id)
            try:  # answered definitely: committed, or never to be written
                written = await self.prompts.send_raw(
                    PROMPTS, conversation_key(conversation), value, trace,
                    deadline=admitted.deadline)
            except RecordTooLarge as exc:
                raise PromptTooLarge(exc.size, exc.limit) from exc
            except ProduceError as exc:
                log.warning("prompt %s not accepted: %s", prompt.request_id, exc)
                KAFKA.trip(exc)
                raise LogUnavailable(prompt.request_id) from exc
            self.follow.written(sub, written.offset)
            if view is not None:
                await self._judge(view, prompt, written.offset)
                original = view.turns[prompt.request_id]
                if original.prompt_offset != written.offset:
                    # An idempotent retry that raced its original and lost runs as the
                    # original, which may have started (and streamed) before this
                    # following began: it is followed as a late client follows a turn,
                    # from the log.
                    self.follow.unfollow(sub)
                    self.metrics.idempotent_replays.inc()
                    return await self.follow.attach_turn(view, original, admitted.tenant,
                                                         None)
            following = self.follow.accepted(sub, prompt)
        except BaseException:
            self.follow.unfollow(sub)
            raise
        self.metrics.accepted.inc()
        if admitted.routed_by is not None:
            self.metrics.routed.labels(admitted.routed_by.alias, admitted.version).inc()
        return following

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
