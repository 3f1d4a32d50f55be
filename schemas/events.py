"""The events of a conversation: frozen pydantic models with no I/O.

Every event carries ``type`` (its discriminator), ``v`` (its schema version),
``event_id``, ``conversation_id``, ``request_id``, ``occurred_at`` and ``tenant``.
The envelope (topic, key, position) and the codec live in ``pipeline``.

Events are tolerant readers: a field this code does not know (written by a newer
producer during a rolling deploy) is accepted and kept, so re-encoding an event and
auditing it show it. A version only ever adds optional fields; an event older than
its type's current version is brought up to it by the upcasters in
``schemas.versions`` before it is validated. A change that old readers could not
ignore needs a new event type.
"""

from __future__ import annotations

import os
import threading
import uuid
from datetime import UTC, datetime
from typing import Annotated, ClassVar, Literal, TypedDict

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    model_validator,
)

Role = Literal["system", "user", "assistant", "tool", "developer"]
FinishReason = Literal["stop", "length", "abort", "error"]


def _now() -> datetime:
    return datetime.now(UTC)


class _EventIds(threading.local):
    """Random (version 4) UUIDs, as ``uuid.uuid4`` makes them from the OS's random source,
    but 256 per system call: a worker makes one per token delta, and one ``getrandom``
    call each was a fifth of its event loop's time under load. Per thread, and dropped
    in a forked child, so no two processes or threads hand out the same bytes."""

    PER_CALL = 256

    def __init__(self) -> None:
        self.pool: list[int] = []

    def __call__(self) -> uuid.UUID:
        if not self.pool:
            raw = os.urandom(16 * self.PER_CALL)
            self.pool = [int.from_bytes(raw[i:i + 16], "big") for i in range(0, len(raw), 16)]
        bits = self.pool.pop()
        # As uuid.uuid4: version 4, RFC 4122 variant.
        bits = (bits & ~(0xF000 << 64)) | (0x4000 << 64)
        bits = (bits & ~(0xC000 << 48)) | (0x8000 << 48)
        return uuid.UUID(int=bits)


new_event_id = _EventIds()
os.register_at_fork(after_in_child=lambda: new_event_id.pool.clear())


# What every record must be to reach a consumer's logic at all (one rule, here, for all
# of them: a record outside it does not decode, and each consumer dead-letters what does
# not decode). Numbers are finite and at most ``MAX_COUNT``; times carry a zone and lie
# within ``EARLIEST``..``LATEST``; names (ids, tenants, models) hold no NUL and no lone
# surrogate. Free text (messages, replies, titles) may hold anything: each reader stores
# it by its own rule (``schemas.conversation.storable``).
MAX_COUNT = 2**53  # exact in every JSON reader, and in a PostgreSQL bigint
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2999, 12, 31, tzinfo=UTC)


def _plausible(at: datetime) -> datetime:
    if not EARLIEST <= at <= LATEST:
        raise ValueError(f"a time from {EARLIEST:%Y} to {LATEST:%Y}, not {at.isoformat()}")
    return at


def _a_name(text: str) -> str:
    if "\0" in text:
        raise ValueError("a name holds no NUL")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a name holds no lone surrogate") from None
    return text


Time = Annotated[AwareDatetime, AfterValidator(_plausible)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_a_name)]
Millis = Annotated[float, Field(ge=0, le=1e12)]  # 31 years


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)


class ChatMessage(Frozen):
    role: Role
    content: str


class SamplingParams(Frozen):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # vLLM's: above 1 favours new tokens, below 1 repeated ones (a finite number over 0).
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    stop: tuple[str, ...] = ()
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=1)
    # Generate max_tokens even past end-of-sequence (benchmarks, tests), as vLLM allows.
    ignore_eos: bool = False


class Usage(Frozen):
    prompt_tokens: Count
    completion_tokens: Count

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class EventIds(TypedDict, total=False):
    """The identifying fields one turn's events share, to pass as ``**ids``."""

    conversation_id: uuid.UUID
    request_id: str
    tenant: str


class Sealed(Frozen):
    """Where an event's content was: sealed with its conversation's data key
    (``pipeline.sealing``). ``key``: the key's id (``"erased"``: the writer dropped the
    content, its keys being destroyed); ``box``: base64 of the nonce and ciphertext. A
    reader holding the key gets the event back with its content and no ``sealed``; one
    without it gets the content fields empty, and ``sealed`` still set."""

    key: Name
    box: str = Field(max_length=2**30)


class EventBase(Frozen):
    v: int = 1
    event_id: uuid.UUID = Field(default_factory=new_event_id)
    conversation_id: uuid.UUID
    request_id: Name
    occurred_at: Time = Field(default_factory=_now)
    tenant: Name = "default"
    sealed: Sealed | None = None
    # Fields added within a version that a record leaves out while they are empty (as
    # every field that is None): older readers never knew them, and most events hold
    # nothing there.
    OMITTED_EMPTY: ClassVar[frozenset[str]] = frozenset()

    @property
    def erased(self) -> bool:
        """Whether this event's content was sealed and cannot be opened here (its keys
        were destroyed): its content fields are empty."""
        return self.sealed is not None


class TurnRef(Frozen):
    """Where a turn lies in the durable record, in its conversation's partition: its
    accepted prompt's offset in ``chat.prompts`` and its end's (the first
    ``GenerationFinished`` or ``GenerationFailed``) in ``chat.generations``."""

    prompt: Count
    end: Count


class Charge(Frozen):
    """What a turn was charged against its API key's tokens per minute when it was
    accepted (its prompt, and ``max_tokens`` or a default). The projector trues the
    key's bucket up to the turn's real usage when it ends."""

    key_id: Name
    tokens: Count


# A history digest: sha256 of the canonical history, lowercase hex (``schemas.history``).
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Recalled(Frozen):
    """A memory added to a turn's input: ``id``, the remembered turn's request id (one
    of the same tenant's and user's, ``memory``); ``text``, what the model was given."""

    id: Name
    text: str


class PromptSubmitted(EventBase):
    """A turn the gateway accepted: the turn's new messages, where the model's input
    continues from, and how to sample.

    v2 adds ``history_end``: the turn's history was read from the log up to (not
    including) this offset of the conversation's ``chat.prompts`` partition. If another
    turn of the conversation was accepted at or after that offset, and before this
    prompt, this prompt is void: built on a stale history, it is never run or stored
    (``schemas.conversation.TurnLedger``). None: a new conversation, no history read.

    v3 adds the routing decision: ``model`` is the version that serves the turn;
    ``alias``, the model the client asked for when it named an alias
    (``schemas.rollout``), and ``rollout``, the id of the rollout record that routed it.

    v4 stops repeating the session: ``messages`` are this turn's new messages only, and
    the ``history_len`` messages before them are given by reference, ``previous`` (the
    session's last turn; the model's input is that turn's input, its new messages and
    its reply: ``schemas.history``), or inline, ``history`` (a prompt of v3, or one whose
    previous turn the gateway could not place). ``history_digest`` is what the gateway
    read the history to be, so a worker and an auditor can check what they rebuild.
    ``charge`` (optional, added within v4): what the turn was charged against its key's
    rate limit, trued up to its usage when it ends.
    ``memory``, ``user`` and ``recalled`` (optional, added within v4): the turn is
    remembered for its tenant's ``user`` once it finishes, and ``recalled`` are the
    user's memories the model was given before the session (``schemas.history.recall``),
    sealed as the messages are.
    """

    v: int = 4
    type: Literal["PromptSubmitted"] = "PromptSubmitted"
    history_end: Count | None = None
    model: Name
    alias: Name | None = None
    rollout: Name | None = None
    # This turn's new messages; they take the conversation's positions from
    # ``history_len`` on.
    messages: tuple[ChatMessage, ...] = Field(min_length=1)
    # How many messages of the session come before this turn's.
    history_len: Count = 0
    history: tuple[ChatMessage, ...] | None = None
    previous: TurnRef | None = None
    history_digest: Digest | None = None
    sampling: SamplingParams = SamplingParams()
    idempotency_key: str | None = None
    # Keep generating when every client has gone away (a client asked for it).
    background: bool = False
    charge: Charge | None = None
    OMITTED_EMPTY: ClassVar[frozenset[str]] = frozenset({"memory", "recalled"})
    memory: bool = False
    user: Name | None = None
    recalled: tuple[Recalled, ...] = ()

    @model_validator(mode="after")
    def _memory_has_a_user(self) -> PromptSubmitted:
        # (Sealed, its user is in the box: ``schemas.content``.)
        if (self.memory or self.recalled) and self.user is None and self.sealed is None:
            raise ValueError("a turn with memory names its user")
        return self

    @model_validator(mode="after")
    def _history_given_once(self) -> PromptSubmitted:
        if not self.history_len:
            if self.history or self.previous is not None:
                raise ValueError("a prompt without history_len names no history")
        elif self.history is not None:
            if len(self.history) != self.history_len or self.previous is not None:
                raise ValueError("an inline history holds history_len messages, and no "
                                 "previous turn besides")
        elif self.previous is None:
            raise ValueError("history_len needs the history inline or a previous turn")
        return self

    @property
    def reply_seq(self) -> int:
        """Position of this turn's assistant reply within the conversation."""
        return self.history_len + len(self.messages)


class GenerationCancelled(EventBase):
    """Stop the turn now (a client asked to)."""

    type: Literal["GenerationCancelled"] = "GenerationCancelled"
    reason: str = "client"


class ClientDetached(EventBase):
    """A client following the turn went away. The worker stops the turn after
    ``grace_s`` unless some client attaches again first (or the turn is ``background``)."""

    type: Literal["ClientDetached"] = "ClientDetached"
    attachment: Name
    grace_s: float = Field(ge=0, le=86_400 * 365)


class ClientAttached(EventBase):
    """A client (re)attached to a running turn, possibly through another gateway."""

    type: Literal["ClientAttached"] = "ClientAttached"
    attachment: Name


class SessionCreated(EventBase):
    """A session (conversation) was created before its first turn, with a title."""

    type: Literal["SessionCreated"] = "SessionCreated"
    title: str | None = Field(default=None, max_length=200)
    # Added within v1: the session has memory on, for this user (``PromptSubmitted``'s
    # ``memory``, for each of its turns that does not say otherwise).
    memory_user: Name | None = None


class SessionDeleted(EventBase):
    """The session is gone: the store forgets its messages, the gateway refuses it, and
    its data keys are destroyed, so its content is unreadable in every copy of the log.

    v2 adds ``reason``: ``deleted`` (its client deleted it), ``erased`` (an operator
    erased it, or its user: ``pipeline erase``). None: written before v2 (deleted)."""

    v: int = 2
    type: Literal["SessionDeleted"] = "SessionDeleted"
    reason: Literal["deleted", "erased"] | None = None


class MemoryForgotten(EventBase):
    """A user's memory is forgotten: the turn ``request_id`` of this conversation is no
    longer recalled for ``user`` (``DELETE /v1/memories``). Its text stays in the turn;
    deleting the session erases that."""

    type: Literal["MemoryForgotten"] = "MemoryForgotten"
    user: Name


class GenerationStarted(EventBase):
    """A worker began (``attempt`` 0) or took over (``attempt`` n) the turn's generation,
    at its first token: one per attempt. ``prompt_tokens``: what the engine read, earlier
    attempts' output included.

    v2 adds ``ref``, the turn's prompt offset: its text streams in ``chat.live`` under
    that reference (``schemas.live``). None (v1, the code before): the turn's
    ``TokenDelta`` events are in ``chat.generations`` itself."""

    v: int = 2
    type: Literal["GenerationStarted"] = "GenerationStarted"
    ref: Count | None = None
    model: Name
    worker: Name
    attempt: Count = 0
    reply_seq: Count
    prompt_tokens: Count


class TokenDelta(EventBase):
    """Text the model generated, in order: ``seq`` counts from 0 with no gap per turn,
    across attempts (a reader drops a ``(request_id, seq)`` it has seen).

    Written to ``chat.generations`` by the code before the live stream (``chat.live``,
    ``schemas.live``): read in logs of then, never written now."""

    type: Literal["TokenDelta"] = "TokenDelta"
    attempt: Count = 0
    seq: Count
    text: str
    token_ids: tuple[int, ...] = ()


class GenerationFinished(EventBase):
    """The turn's end: its whole text, usage and timings. ``finish_reason`` ``abort``:
    cancelled (by its client, or no client came back within its grace)."""

    v: int = 2
    type: Literal["GenerationFinished"] = "GenerationFinished"
    ref: Count | None = None  # v2: as GenerationStarted's
    model: Name
    attempt: Count = 0
    reply_seq: Count
    finish_reason: FinishReason
    text: str
    usage: Usage
    # Number of deltas before this one, so readers can detect loss.
    deltas: Count
    ttft_ms: Millis | None = None
    duration_ms: Millis


class GenerationFailed(EventBase):
    """The turn's end without a reply: ``code`` says why (``model_not_served``,
    ``context_length_exceeded``, ``engine_dead``, ...)."""

    v: int = 2
    type: Literal["GenerationFailed"] = "GenerationFailed"
    ref: Count | None = None  # v2: as GenerationStarted's
    attempt: Count = 0
    code: Name
    message: str


Event = Annotated[
    PromptSubmitted
    | GenerationCancelled
    | ClientDetached
    | ClientAttached
    | SessionCreated
    | SessionDeleted
    | MemoryForgotten
    | GenerationStarted
    | TokenDelta
    | GenerationFinished
    | GenerationFailed,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

# What chat.generations carries.
GenerationEvent = GenerationStarted | TokenDelta | GenerationFinished | GenerationFailed
