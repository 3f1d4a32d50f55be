"""A conversation as the gateway needs it: the stored rows plus the events the
projector has not applied yet, folded the way the projection applies them. No I/O.

The projection (``projections.projection``) is the authority on what events mean
for the store; this fold follows it for the fields the gateway reads (messages,
turn status, deletion), and a test holds the two equal.
"""

from __future__ import annotations

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
)

RUNNING = ("pending", "running")


@dataclass
class Message:
    role: str
    content: str
    request_id: str
    created_at: datetime


@dataclass
class TurnState:
    request_id: str
    status: str = "pending"
    model: str | None = None
    submitted_at: datetime | None = None
    idempotency_key: str | None = None


@dataclass
class ConversationView:
    id: object
    tenant: str | None = None
    title: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    deleted: bool = False
    messages: dict[int, Message] = field(default_factory=dict)
    turns: dict[str, TurnState] = field(default_factory=dict)

    def visible_to(self, tenant: str) -> bool:
        return self.tenant == tenant and not self.deleted

    def history(self) -> list[ChatMessage]:
        return [ChatMessage(role=m.role, content=m.content)  # type: ignore[arg-type]
                for _, m in sorted(self.messages.items())]

    def busy(self) -> TurnState | None:
        return next((t for t in self.turns.values() if t.status in RUNNING), None)

    def by_idempotency_key(self, key: str) -> TurnState | None:
        return next((t for t in self.turns.values() if t.idempotency_key == key), None)

    def _touch(self, event: Event) -> None:
        self.tenant = self.tenant or event.tenant
        at = event.occurred_at
        self.created_at = min(self.created_at, at) if self.created_at else at
        self.updated_at = max(self.updated_at, at) if self.updated_at else at

    def _add_message(self, seq: int, role: str, content: str, request_id: str,
                     at: datetime) -> None:
        if not self.deleted:
            self.messages.setdefault(seq, Message(role, content.replace("\x00", "\ufffd"),
                                                  request_id, at))

    def apply(self, event: Event) -> None:
        """Fold one event in, as the projection would (idempotent, order-tolerant)."""
        if isinstance(event, SessionDeleted):
            self._touch(event)
            self.deleted, self.title = True, None
            self.messages.clear()
            return
        if isinstance(event, SessionCreated):
            self._touch(event)
            if not self.deleted:
                self.title = self.title or event.title
        elif isinstance(event, PromptSubmitted):
            self._touch(event)
            for seq in range(event.history_len, len(event.messages)):
                msg = event.messages[seq]
                self._add_message(seq, msg.role, msg.content, event.request_id,
                                  event.occurred_at)
            if not self.deleted and not self.title and not event.history_len:
                first = next((m.content for m in event.messages if m.role == "user"), "")
                self.title = " ".join(first.replace("\x00", "\ufffd").split())[:80] or None
            turn = self.turns.setdefault(event.request_id, TurnState(event.request_id))
            turn.model, turn.submitted_at = event.model, event.occurred_at
            turn.idempotency_key = event.idempotency_key
        elif isinstance(event, GenerationStarted):
            self._touch(event)
            turn = self.turns.setdefault(event.request_id, TurnState(event.request_id))
            if turn.status == "pending":
                turn.status = "running"
        elif isinstance(event, GenerationFinished):
            self._touch(event)
            self._add_message(event.reply_seq, "assistant", event.text, event.request_id,
                              event.occurred_at)
            turn = self.turns.setdefault(event.request_id, TurnState(event.request_id))
            turn.status = "cancelled" if event.finish_reason == "abort" else "finished"
        elif isinstance(event, GenerationFailed):
            self._touch(event)
            self.turns.setdefault(event.request_id, TurnState(event.request_id)).status = "failed"
