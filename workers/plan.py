"""What the worker does with a prompt when a slot is free for it, and with a running turn
when a client leaves or comes back. Pure functions, no I/O: the worker's loop carries
them out.

* ``plan_start``: a prompt is **skipped** when its turn already ended (it finished before
  its offset was committed, found in the log on takeover) or ended or runs here (an
  idempotent retry racing its original); **ended unstarted** when control says it must
  not start (``workers.control``); otherwise **run**, continuing after what earlier
  attempts emitted, under the next attempt.
* ``stop_at``: when a running turn must stop because every client left (None: it runs on).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from schemas import PromptSubmitted
from schemas.live import Delta
from workers.control import ControlBook
from workers.recovery import Recovered


@dataclass
class Progress:
    """A turn's generation so far, including what earlier attempts emitted."""

    attempt: int = 0
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Earlier attempts' deltas that only ``chat.generations`` holds (the code before the
    # live stream wrote them): this attempt writes them to the live stream first.
    republish: list[Delta] = field(default_factory=list)
    # This attempt follows one stopped here to give its slot up (``workers.fairness``).
    preempted: bool = False

    @classmethod
    def resumed(cls, rec: Recovered) -> Progress:
        emitted = rec.emitted()
        return cls(rec.attempt + 1, [d.text for d in emitted],
                   [t for d in emitted for t in d.token_ids],
                   emitted if rec.legacy else [])

    def continued(self) -> Progress:
        """The next attempt after this one was stopped here to give its slot up: it goes
        on after the deltas this one wrote (``seq`` stays gap-free)."""
        return Progress(self.attempt + 1, self.parts, self.token_ids, preempted=True)


class Action(enum.Enum):
    SKIP = "skip"
    END = "end"  # end it now as cancelled, without starting the engine
    RUN = "run"


@dataclass(frozen=True)
class Plan:
    action: Action
    progress: Progress = field(default_factory=Progress)
    reason: str = ""


def plan_start(prompt: PromptSubmitted, recovered: Recovered | None, here: bool,
               book: ControlBook, now: datetime, stopped: Progress | None = None) -> Plan:
    """``recovered``: what the log holds of its turn from earlier owners; ``here``: whether
    its turn ended or runs in this worker already; ``stopped``: its progress, if an
    attempt here was stopped to give its slot up."""
    if here:
        return Plan(Action.SKIP, reason="it ended or runs here already")
    if recovered is not None and recovered.ended:
        return Plan(Action.SKIP, reason="it ended before its offset was committed")
    progress = (stopped.continued() if stopped is not None
                else Progress.resumed(recovered) if recovered is not None else Progress())
    decision = book.decide(prompt, now)
    if not decision.start:
        return Plan(Action.END, progress, decision.reason)
    return Plan(Action.RUN, progress)


def stop_at(book: ControlBook, prompt: PromptSubmitted) -> datetime | None:
    """When the running turn of ``prompt`` must stop because its clients left."""
    control = book.turn(prompt.request_id)
    since = control.abandoned_since
    if since is None or prompt.background:
        return None
    return since + timedelta(seconds=control.grace_s)
