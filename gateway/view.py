"""A conversation as the gateway needs it: the stored rows plus the events the
projector has not applied yet, folded the way the projection applies them. No I/O.

Both follow ``schemas.conversation`` (storable text, titles, statuses, which prompts
are void); a test feeds the same events to both and holds them equal.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from schemas import (
    ChatMessage,
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SessionCreated,
    SessionDeleted,
    TurnRef,
    Usage,
)
from schemas.conversation import (
    FAILED,
    PENDING,
    RUNNING,
    UNFINISHED,
    TurnLedger,
    Verdict,
    ended_status,
    storable,
    title,
)


@dataclass
class Message:
    role: str
    content: str
    request_id: str
    created_at: datetime


@dataclass
class TurnState:
    request_id: str
    status: str = PENDING
    model: str | None = None
    submitted_at: datetime | None = None
    prompt_offset: int | None = None  # where its accepted prompt is in chat.prompts
    end_offset: int | None = None  # where its first end is in chat.generations
    ended_at: datetime | None = None  # when its worker ended it (its end's time)
    started_at: datetime | None = None  # when its first attempt started (its worker's time)
    finish_reason: str | None = None  # its last GenerationFinished's, as the store keeps it
    usage: Usage | None = None  # that end's
    error: tuple[str, str] | None = None  # its last GenerationFailed's code and message


@dataclass
class ConversationView:
    id: uuid.UUID
    tenant: str | None = None
    title: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    deleted: bool = False
    memory_user: str | None = None  # the session has memory on, for this user
    messages: dict[int, Message] = field(default_factory=dict)
    turns: dict[str, TurnState] = field(default_factory=dict)
    # The end of the conversation's chat.prompts partition when the view was read: a
    # turn built on this view's history names it as its ``history_end``.
    prompts_end: int | None = None
    ledger: TurnLedger = field(default_factory=TurnLedger)
    # Void prompts seen by the fold (never stored): request id -> the turn that counts.
    void: dict[str, str] = field(default_factory=dict)
    # The conversation's data keys the store knows (references, oldest first): its
    # content is sealed with the first (``pipeline.keystore``).
    key_refs: list[str] = field(default_factory=list)

    def visible_to(self, tenant: str) -> bool:
        return self.tenant == tenant and not self.deleted

    def history(self) -> list[ChatMessage]:
        return [ChatMessage(role=m.role, content=m.content)  # type: ignore[arg-type]
                for _, m in sorted(self.messages.items())]

    def busy(self) -> TurnState | None:
        return next((t for t in self.turns.values() if t.status in UNFINISHED), None)

    def last_turn(self) -> TurnRef | None:
        """Where the session's last turn lies, for the next prompt to name as its history;
        None if it has no turn, or if its last one cannot be placed (stored before turns'
        ends were, or one whose prompt the log never showed)."""
        placed = [t for t in self.turns.values() if t.prompt_offset is not None]
        if not placed:
            return None
        last = max(placed, key=lambda t: t.prompt_offset or 0)
        if last.end_offset is None or len(placed) < len(self.turns):
            return None
        assert last.prompt_offset is not None
        return TurnRef(prompt=last.prompt_offset, end=last.end_offset)

    def stored_turn(self, turn: TurnState) -> None:
        """A turn as the store holds it (its prompt already judged)."""
        self.turns[turn.request_id] = turn
        if turn.prompt_offset is not None:
            self.ledger.know(self.id, turn.prompt_offset, turn.request_id)

    def _touch(self, event: Event) -> None:
        self.tenant = self.tenant or event.tenant
        at = event.occurred_at
        self.created_at = min(self.created_at, at) if self.created_at else at
        self.updated_at = max(self.updated_at, at) if self.updated_at else at

    def _add_message(self, seq: int, role: str, content: str, request_id: str,
                     at: datetime) -> None:
        if not self.deleted:
            self.messages.setdefault(seq, Message(role, storable(content), request_id, at))

    def _turn(self, request_id: str) -> TurnState:
        return self.turns.setdefault(request_id, TurnState(request_id))

    def apply(self, event: Event, offset: int) -> None:
        """Fold in one event found at ``offset`` of its topic, as the projection would
        (idempotent, tolerant of the order between topics)."""
        if self.tenant is not None and event.tenant != self.tenant:
            return  # another tenant's event changes nothing of this conversation
        if isinstance(event, SessionDeleted):
            self._touch(event)
            self.deleted, self.title = True, None
            self.messages.clear()
            return
        if isinstance(event, SessionCreated):
            self._touch(event)
            if not self.deleted:
                self.title = title(event.title) or self.title  # its own title wins
                self.memory_user = self.memory_user or event.memory_user
        elif isinstance(event, PromptSubmitted):
            self._apply_prompt(event, offset)
        elif isinstance(event, GenerationStarted):
            self._touch(event)
            turn = self._turn(event.request_id)
            if turn.status == PENDING:
                turn.status = RUNNING
            at = event.occurred_at
            turn.started_at = min(turn.started_at, at) if turn.started_at else at
        elif isinstance(event, GenerationFinished):
            self._touch(event)
            self._add_message(event.reply_seq, "assistant", event.text, event.request_id,
                              event.occurred_at)
            turn = self._turn(event.request_id)
            turn.status = ended_status(event.finish_reason)
            turn.finish_reason, turn.usage = event.finish_reason, event.usage
            self._ended(turn, event, offset)
        elif isinstance(event, GenerationFailed):
            self._touch(event)
            turn = self._turn(event.request_id)
            turn.status = FAILED
            turn.error = (event.code, event.message)
            self._ended(turn, event, offset)

    @staticmethod
    def _ended(turn: TurnState, event: Event, offset: int) -> None:
        if turn.end_offset is None:
            turn.end_offset, turn.ended_at = offset, event.occurred_at

    def _apply_prompt(self, event: PromptSubmitted, offset: int) -> None:
        decision = self.ledger.decide(self.id, event.request_id, event.history_end, offset)
        if decision.verdict is Verdict.VOID:
            assert decision.rival is not None
            self.void[event.request_id] = decision.rival
            return  # never run, never stored
        self.void.pop(event.request_id, None)
        self._touch(event)
        turn = self._turn(event.request_id)
        if turn.prompt_offset is None:
            turn.prompt_offset = offset
        for seq, msg in enumerate(event.messages, start=event.history_len):
            self._add_message(seq, msg.role, msg.content, event.request_id, event.occurred_at)
        if not self.deleted and not self.title and not event.history_len:
            self.title = title(next((m.content for m in event.messages if m.role == "user"),
                                    ""))
        turn.model, turn.submitted_at = event.model, event.occurred_at
