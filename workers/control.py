"""What the control events say about turns, whether they run yet or not. No I/O.

A worker reads ``chat.control`` whether or not its engine has room, so it learns of
a cancel, a client leaving or coming back, or a session deleted as soon as it is
written, also for turns whose prompts still wait in ``chat.prompts``. ``ControlBook``
remembers those facts; when a prompt comes up, ``decide`` says whether it may start:

* cancelled, or its session deleted: never started;
* abandoned (not ``background``, every client gone for longer than the grace period):
  never started;

The grace counts from when a client's leaving was in the log (the broker's append
time of its ``ClientDetached``, ``chat.control`` being a ``LogAppendTime`` topic), not
from when the gateway wrote it: while the log is away no client can come back either,
so a departure written during an outage gets its whole grace once the log returns.
* every client gone, grace not yet over: started, to be stopped when the grace ends
  unless a client comes back (``stop_at``);
* otherwise started.

The book forgets the oldest turns past ``capacity`` entries.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import (
    ClientAttached,
    ClientDetached,
    Event,
    GenerationCancelled,
    PromptSubmitted,
    SessionDeleted,
)


@dataclass
class TurnControl:
    """The control facts about one turn. The original request is a client from the start."""

    request_id: str
    cancelled: bool = False
    attached: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)  # attachments that detached
    # When the last client left, and how long the turn may run on without one.
    left_at: datetime | None = None
    grace_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.attached and self.request_id not in self.gone:
            self.attached.add(self.request_id)

    def detach(self, event: ClientDetached, logged_at: datetime | None = None) -> None:
        self.attached.discard(event.attachment)
        self.gone.add(event.attachment)
        if not self.attached:
            left = event.occurred_at if logged_at is None else max(event.occurred_at,
                                                                    logged_at)
            self.left_at, self.grace_s = left, event.grace_s

    def attach(self, event: ClientAttached) -> None:
        if event.attachment not in self.gone:
            self.attached.add(event.attachment)
            self.left_at = None

    @property
    def abandoned_since(self) -> datetime | None:
        """When every client had gone (None while one follows the turn)."""
        return self.left_at if not self.attached else None


@dataclass(frozen=True)
class StartDecision:
    start: bool
    reason: str = ""  # why not
    stop_at: datetime | None = None  # stop then, unless a client comes back first


class ControlBook:
    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, TurnControl] = OrderedDict()
        self._deleted: OrderedDict[uuid.UUID, None] = OrderedDict()

    def turn(self, request_id: str) -> TurnControl:
        control = self._turns.get(request_id)
        if control is None:
            control = self._turns[request_id] = TurnControl(request_id)
            while len(self._turns) > self.capacity:
                self._turns.popitem(last=False)
        return control

    def apply(self, event: Event, logged_at: datetime | None = None) -> None:
        """Record a control event (others are ignored); ``logged_at``: when the log
        appended it."""
        if isinstance(event, GenerationCancelled):
            self.turn(event.request_id).cancelled = True
        elif isinstance(event, ClientDetached):
            self.turn(event.request_id).detach(event, logged_at)
        elif isinstance(event, ClientAttached):
            self.turn(event.request_id).attach(event)
        elif isinstance(event, SessionDeleted):
            self._deleted[event.conversation_id] = None
            while len(self._deleted) > self.capacity:
                self._deleted.popitem(last=False)

    def deleted(self, conversation_id: uuid.UUID) -> bool:
        return conversation_id in self._deleted

    def decide(self, prompt: PromptSubmitted, now: datetime) -> StartDecision:
        """Whether the turn of ``prompt`` may start now."""
        if self.deleted(prompt.conversation_id):
            return StartDecision(False, "its session was deleted")
        if prompt.erased:  # its keys were destroyed before it ran (pipeline.sealing)
            return StartDecision(False, "its session was erased")
        control = self._turns.get(prompt.request_id)
        if control is None:
            return StartDecision(True)
        if control.cancelled:
            return StartDecision(False, "cancelled before it started")
        since = control.abandoned_since
        if since is None or prompt.background:
            return StartDecision(True)
        remaining = control.grace_s - (now - since).total_seconds()
        if remaining <= 0:
            return StartDecision(False, "every client left before it started")
        return StartDecision(True, stop_at=since + timedelta(seconds=control.grace_s))

    def forget(self, request_id: str) -> None:
        self._turns.pop(request_id, None)

