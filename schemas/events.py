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
from typing import Annotated, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

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


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class ChatMessage(Frozen):
    role: Role
    content: str


class SamplingParams(Frozen):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    # Generate max_tokens even past end-of-sequence (benchmarks, tests), as vLLM allows.
    ignore_eos: bool = False


class Usage(Frozen):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class EventIds(TypedDict, total=False):
    """The identifying fields one turn's events share, to pass as ``**ids``."""

    conversation_id: uuid.UUID
    request_id: str
    tenant: str


class EventBase(Frozen):
    v: int = 1
    event_id: uuid.UUID = Field(default_factory=new_event_id)
    conversation_id: uuid.UUID
    request_id: str = Field(min_length=1, max_length=200)
    occurred_at: datetime = Field(default_factory=_now)
    tenant: str = Field(default="default", min_length=1, max_length=200)


class TurnRef(Frozen):
    """Where a turn lies in the durable record, in its conversation's partition: its
    accepted prompt's offset in ``chat.prompts`` and its end's (the first
    ``GenerationFinished`` or ``GenerationFailed``) in ``chat.generations``."""

    prompt: int = Field(ge=0)
    end: int = Field(ge=0)


# A history digest: sha256 of the canonical history, lowercase hex (``schemas.history``).
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


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
    (``pipeline.rollout``), and ``rollout``, the id of the rollout record that routed it.

    v4 stops repeating the session: ``messages`` are this turn's new messages only, and
    the ``history_len`` messages before them are given by reference, ``previous`` (the
    session's last turn; the model's input is that turn's input, its new messages and
    its reply: ``schemas.history``), or inline, ``history`` (a prompt of v3, or one whose
    previous turn the gateway could not place). ``history_digest`` is what the gateway
    read the history to be, so a worker and an auditor can check what they rebuild.
    """

    v: int = 4
    type: Literal["PromptSubmitted"] = "PromptSubmitted"
    history_end: int | None = Field(default=None, ge=0)
    model: str
    alias: str | None = Field(default=None, max_length=200)
    rollout: str | None = Field(default=None, max_length=200)
    # This turn's new messages; they take the conversation's positions from
    # ``history_len`` on.
    messages: tuple[ChatMessage, ...] = Field(min_length=1)
    # How many messages of the session come before this turn's.
    history_len: int = Field(default=0, ge=0)
    history: tuple[ChatMessage, ...] | None = None
    previous: TurnRef | None = None
    history_digest: Digest | None = None
    sampling: SamplingParams = SamplingParams()
    idempotency_key: str | None = None
    # Keep generating when every client has gone away (a client asked for it).
    background: bool = False

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
    attachment: str = Field(min_length=1, max_length=200)
    grace_s: float = Field(ge=0)


class ClientAttached(EventBase):
    """A client (re)attached to a running turn, possibly through another gateway."""

    type: Literal["ClientAttached"] = "ClientAttached"
    attachment: str = Field(min_length=1, max_length=200)


class SessionCreated(EventBase):
    """A session (conversation) was created before its first turn, with a title."""

    type: Literal["SessionCreated"] = "SessionCreated"
    title: str | None = Field(default=None, max_length=200)


class SessionDeleted(EventBase):
    """The session is gone: the store forgets its messages, the gateway refuses it."""

    type: Literal["SessionDeleted"] = "SessionDeleted"


class GenerationStarted(EventBase):
    """A worker began (``attempt`` 0) or took over (``attempt`` n) the turn's generation,
    at its first token: one per attempt. ``prompt_tokens``: what the engine read, earlier
    attempts' output included.

    v2 adds ``ref``, the turn's prompt offset: its text streams in ``chat.live`` under
    that reference (``schemas.live``). None (v1, the code before): the turn's
    ``TokenDelta`` events are in ``chat.generations`` itself."""

    v: int = 2
    type: Literal["GenerationStarted"] = "GenerationStarted"
    ref: int | None = Field(default=None, ge=0)
    model: str
    worker: str
    attempt: int = Field(default=0, ge=0)
    reply_seq: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)


class TokenDelta(EventBase):
    """Text the model generated, in order: ``seq`` counts from 0 with no gap per turn,
    across attempts (a reader drops a ``(request_id, seq)`` it has seen).

    Written to ``chat.generations`` by the code before the live stream (``chat.live``,
    ``schemas.live``): read in logs of then, never written now."""

    type: Literal["TokenDelta"] = "TokenDelta"
    attempt: int = Field(default=0, ge=0)
    seq: int = Field(ge=0)
    text: str
    token_ids: tuple[int, ...] = ()


class GenerationFinished(EventBase):
    """The turn's end: its whole text, usage and timings. ``finish_reason`` ``abort``:
    cancelled (by its client, or no client came back within its grace)."""

    v: int = 2
    type: Literal["GenerationFinished"] = "GenerationFinished"
    ref: int | None = Field(default=None, ge=0)  # v2: as GenerationStarted's
    model: str
    attempt: int = Field(default=0, ge=0)
    reply_seq: int = Field(ge=0)
    finish_reason: FinishReason
    text: str
    usage: Usage
    # Number of deltas before this one, so readers can detect loss.
    deltas: int = Field(ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    duration_ms: float = Field(ge=0)


class GenerationFailed(EventBase):
    """The turn's end without a reply: ``code`` says why (``model_not_served``,
    ``context_length_exceeded``, ``engine_dead``, ...)."""

    v: int = 2
    type: Literal["GenerationFailed"] = "GenerationFailed"
    ref: int | None = Field(default=None, ge=0)  # v2: as GenerationStarted's
    attempt: int = Field(default=0, ge=0)
    code: str
    message: str


Event = Annotated[
    PromptSubmitted
    | GenerationCancelled
    | ClientDetached
    | ClientAttached
    | SessionCreated
    | SessionDeleted
    | GenerationStarted
    | TokenDelta
    | GenerationFinished
    | GenerationFailed,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

# What chat.generations carries.
GenerationEvent = GenerationStarted | TokenDelta | GenerationFinished | GenerationFailed
