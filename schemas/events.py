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

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

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


class PromptSubmitted(EventBase):
    """A turn the gateway accepted: the messages the model sees, and how to sample.

    v2 adds ``history_end``: the turn's history was read from the log up to (not
    including) this offset of the conversation's ``chat.prompts`` partition. If another
    turn of the conversation was accepted at or after that offset, and before this
    prompt, this prompt is void: built on a stale history, it is never run or stored
    (``schemas.conversation.TurnLedger``). None: a new conversation, no history read.

    v3 adds the routing decision: ``model`` is the version that serves the turn;
    ``alias``, the model the client asked for when it named an alias
    (``pipeline.rollout``), and ``rollout``, the id of the rollout record that routed it.
    """

    v: int = 3
    type: Literal["PromptSubmitted"] = "PromptSubmitted"
    history_end: int | None = Field(default=None, ge=0)
    model: str
    alias: str | None = Field(default=None, max_length=200)
    rollout: str | None = Field(default=None, max_length=200)
    messages: tuple[ChatMessage, ...] = Field(min_length=1)
    # The first ``history_len`` messages came from the stored session; the rest are
    # this turn's new messages. Their positions in the conversation follow from it.
    history_len: int = Field(default=0, ge=0)
    sampling: SamplingParams = SamplingParams()
    idempotency_key: str | None = None
    # Keep generating when every client has gone away (a client asked for it).
    background: bool = False

    @property
    def reply_seq(self) -> int:
        """Position of this turn's assistant reply within the conversation."""
        return len(self.messages)


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
    """A worker began (``attempt`` 0) or took over (``attempt`` n) the turn's generation:
    one per attempt. ``prompt_tokens``: what the engine read, earlier attempts' output
    included."""

    type: Literal["GenerationStarted"] = "GenerationStarted"
    model: str
    worker: str
    attempt: int = Field(default=0, ge=0)
    reply_seq: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)


class TokenDelta(EventBase):
    """Text the model generated, in order: ``seq`` counts from 0 with no gap per turn,
    across attempts (a reader drops a ``(request_id, seq)`` it has seen)."""

    type: Literal["TokenDelta"] = "TokenDelta"
    attempt: int = Field(default=0, ge=0)
    seq: int = Field(ge=0)
    text: str
    token_ids: tuple[int, ...] = ()


class GenerationFinished(EventBase):
    """The turn's end: its whole text, usage and timings. ``finish_reason`` ``abort``:
    cancelled (by its client, or no client came back within its grace)."""

    type: Literal["GenerationFinished"] = "GenerationFinished"
    model: str
    attempt: int = Field(default=0, ge=0)
    reply_seq: int = Field(ge=0)
    finish_reason: FinishReason
    text: str
    usage: Usage
    # Number of TokenDelta events before this one, so readers can detect loss.
    deltas: int = Field(ge=0)
    ttft_ms: float | None = Field(default=None, ge=0)
    duration_ms: float = Field(ge=0)


class GenerationFailed(EventBase):
    """The turn's end without a reply: ``code`` says why (``model_not_served``,
    ``context_length_exceeded``, ``engine_dead``, ...)."""

    type: Literal["GenerationFailed"] = "GenerationFailed"
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
