"""The rules every reader of a conversation applies, so the gateway's read model, the
workers and the projector agree: which text the store can hold, a session's title, a
turn's status, and which prompts are void. Pure functions, no I/O.

**One turn at a time, decided by the log.** A session's next turn is built on its
history as read at some point of the log. Two gateways may both read the session idle
and both append a turn; Kafka's order inside the conversation's partition decides
which one counts. Each prompt names where its history was read (``history_end``,
the end offset of its ``chat.prompts`` partition then). Among the conversation's
prompts at offsets in ``[history_end, offset)`` (appended after that read, before the
prompt), in log order:

* one with the same request id that counts: the prompt is a **duplicate** (an
  idempotent retry racing its original), the same turn again;
* otherwise one with another request id that counts: the prompt is **void**, built
  on a history that no longer holds. It is never run and never stored; the gateway
  that wrote it answers 409 naming the other turn (the log keeps it, for audit);
* otherwise it is **accepted**.

Accepted prompts count; duplicates and void ones do not. The verdict depends only on
prompts of the range, whose verdicts depend on earlier ranges: every reader that
knows those prompts reaches the same verdict, whenever and wherever it reads.
"""

from __future__ import annotations

import enum
import re
import uuid
from bisect import bisect_left, insort
from dataclasses import dataclass

TITLE_CHARS = 80
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# A turn's statuses: pending (accepted, not started), running, and how it ended. A void
# prompt makes no turn.
PENDING, RUNNING, FINISHED, FAILED, CANCELLED = (
    "pending", "running", "finished", "failed", "cancelled")
UNFINISHED = (PENDING, RUNNING)


def storable(text: str) -> str:
    """Text as the store keeps it. PostgreSQL text (and JSON) cannot hold NUL, and UTF-8
    cannot hold an unpaired surrogate: both are shown as U+FFFD (the log keeps the
    original). The gateway refuses both in requests; this covers every other writer."""
    return _UNSTORABLE.sub("\ufffd", text)


def title(text: str | None) -> str | None:
    """A session's title from a requested title or its first user message: storable,
    whitespace collapsed, at most ``TITLE_CHARS`` characters; None if that leaves nothing."""
    return " ".join(storable(text or "").split())[:TITLE_CHARS] or None


def ended_status(finish_reason: str) -> str:
    """The status a ``GenerationFinished`` leaves its turn in."""
    return CANCELLED if finish_reason == "abort" else FINISHED


class Verdict(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    VOID = "void"

    @property
    def counts(self) -> bool:
        return self is Verdict.ACCEPTED


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    rival: str | None = None  # for a void prompt, the turn that counts instead


@dataclass(frozen=True, order=True)
class _Mark:
    offset: int
    request_id: str
    verdict: Verdict


class TurnLedger:
    """Verdicts of prompts, per conversation, in log order.

    ``decide`` must see a conversation's prompts in offset order, and must know every
    prompt of the conversation in ``[history_end, offset)`` (``know`` adds ones decided
    elsewhere, such as rows already stored). Its callers guarantee that coverage.
    """

    def __init__(self) -> None:
        self._marks: dict[uuid.UUID, list[_Mark]] = {}

    def know(self, conversation_id: uuid.UUID, offset: int, request_id: str,
             verdict: Verdict = Verdict.ACCEPTED) -> None:
        marks = self._marks.setdefault(conversation_id, [])
        mark = _Mark(offset, request_id, verdict)
        if mark not in marks:
            insort(marks, mark)

    def decide(self, conversation_id: uuid.UUID, request_id: str, history_end: int | None,
               offset: int) -> Decision:
        marks = self._marks.setdefault(conversation_id, [])
        existing = next((m for m in marks if m.offset == offset), None)
        if existing is not None:  # decided before: the same answer again
            return self._decision(marks, existing.verdict, history_end, offset)
        decision = self._judge(marks, request_id, history_end, offset)
        insort(marks, _Mark(offset, request_id, decision.verdict))
        return decision

    def _decision(self, marks: list[_Mark], verdict: Verdict, history_end: int | None,
                  offset: int) -> Decision:
        if verdict is not Verdict.VOID or history_end is None:
            return Decision(verdict)
        rival = next(m.request_id for m in self._range(marks, history_end, offset)
                     if m.verdict.counts)
        return Decision(verdict, rival)

    @staticmethod
    def _range(marks: list[_Mark], start: int, end: int) -> list[_Mark]:
        first = bisect_left(marks, start, key=lambda m: m.offset)
        return [m for m in marks[first:] if m.offset < end]

    def _judge(self, marks: list[_Mark], request_id: str, history_end: int | None,
               offset: int) -> Decision:
        if history_end is None:
            return Decision(Verdict.ACCEPTED)
        seen = self._range(marks, history_end, offset)
        if any(m.request_id == request_id and m.verdict is not Verdict.VOID for m in seen):
            return Decision(Verdict.DUPLICATE)
        rival = next((m.request_id for m in seen if m.verdict.counts), None)
        if rival is not None:
            return Decision(Verdict.VOID, rival)
        return Decision(Verdict.ACCEPTED)

    def forget_before(self, offset: int) -> None:
        """Drop what lies before ``offset`` (in every conversation of a partition)."""
        for conversation_id in list(self._marks):
            kept = [m for m in self._marks[conversation_id] if m.offset >= offset]
            if kept:
                self._marks[conversation_id] = kept
            else:
                del self._marks[conversation_id]
