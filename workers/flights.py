"""The turns a worker runs, and what the control events do to them: a cancel stops its
turn, a client leaving starts the turn's grace (``workers.control``), a session deleted
stops its turns. Turns that ended here are remembered, so a prompt submitted again (an
idempotent retry racing its original) never runs twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pipeline.codec import TP
from pipeline.logs import turn_fields
from schemas import Event, GenerationCancelled, PromptSubmitted, SessionDeleted
from workers.control import ControlBook
from workers.plan import stop_at

log = logging.getLogger(__name__)
# Turns that ended here, remembered so a re-submitted prompt is not run twice.
ENDED_MEMORY = 100_000


@dataclass
class InFlight:
    tp: TP
    task: asyncio.Task[None]
    prompt: PromptSubmitted
    grace: asyncio.Task[None] | None = None
    cancelled: bool = False
    engine: bool = False  # its task runs it on the engine now
    # Stopped to give its slot to a starved tenant (``workers.fairness``): it waits again,
    # and continues after what it wrote, unless ``abandoned`` (its partition moved on).
    preempted: bool = False
    abandoned: bool = False


class Flights:
    """The turns in flight here, by request id. ``abort(request_id)`` stops one in the
    engine; ``broker_ahead_s()``: the log's brokers' clock less this host's
    (``pipeline.kafka.clock``), which ``log_now`` corrects by."""

    def __init__(self, abort: Callable[[str], Coroutine[Any, Any, None]],
                 broker_ahead_s: Callable[[], float] = lambda: 0.0) -> None:
        self._abort = abort
        self._broker_ahead_s = broker_ahead_s
        self.running: dict[str, InFlight] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.book = ControlBook()  # control events, also of turns not started yet

    def __len__(self) -> int:
        return len(self.running)

    def log_now(self) -> datetime:
        """Now, as the log's brokers stamp it: a client's departure is timed by its
        record's broker time, so its grace counts in theirs, whatever this host's clock
        says (a grace is 10 s by default: a clock that far ahead would stop every turn
        a client stepped away from at once)."""
        return datetime.now(UTC) + timedelta(seconds=self._broker_ahead_s())

    def known(self, request_id: str) -> bool:
        """Whether the turn ran, or runs, here."""
        return request_id in self.ended or request_id in self.running

    def add(self, flight: InFlight, run: bool) -> None:
        """A turn started: run (its grace armed if its clients left), or ended unstarted."""
        self.running[flight.prompt.request_id] = flight
        if run:
            self.arm_grace(flight)

    def forget(self, request_id: str, ended: bool) -> InFlight | None:
        """The turn is no longer in flight; ``ended``: its end is in the log."""
        flight = self.running.pop(request_id, None)
        if flight is not None and flight.grace is not None:
            flight.grace.cancel()
        if ended:
            self.book.forget(request_id)
            self.ended[request_id] = None
            while len(self.ended) > ENDED_MEMORY:
                self.ended.popitem(last=False)
        return flight

    def on_engine(self, request_id: str, on: bool) -> None:
        """The turn's task began its run (``on``), or its run ended and only its end is
        left to write: only a turn on the engine has a slot to take back."""
        flight = self.running.get(request_id)
        if flight is not None:
            flight.engine = on

    def newest_of(self, tenant: str) -> InFlight | None:
        """The turn of ``tenant`` started last that runs on the engine and is not being
        stopped: the cheapest to take a slot back from (the least to prefill again)."""
        for flight in reversed(self.running.values()):
            if (flight.prompt.tenant == tenant and flight.engine and not flight.cancelled
                    and not flight.preempted):
                return flight
        return None

    def in_partitions(self, partitions: list[int]) -> list[InFlight]:
        return [f for f in self.running.values() if f.tp[1] in partitions]

    async def control(self, event: Event, logged: datetime | None) -> None:
        """Apply a control event: to its turn if it runs here, else kept for when its
        prompt comes up."""
        self.book.apply(event, logged)
        if isinstance(event, SessionDeleted):
            for other in list(self.running.values()):
                if other.prompt.conversation_id == event.conversation_id:
                    await self.cancel(other)
            return
        flight = self.running.get(event.request_id)
        if flight is None:
            return
        if isinstance(event, GenerationCancelled):
            await self.cancel(flight)
            return
        self.arm_grace(flight)

    def arm_grace(self, flight: InFlight) -> None:
        """Stop the turn when its grace ends, unless a client follows it again."""
        deadline = stop_at(self.book, flight.prompt)
        if deadline is None:
            if flight.grace is not None:
                flight.grace.cancel()
                flight.grace = None
        elif flight.grace is None:
            left = (deadline - self.log_now()).total_seconds()
            flight.grace = asyncio.create_task(self.cancel(flight, after_s=max(left, 0.0)))

    async def cancel(self, flight: InFlight, after_s: float = 0.0) -> None:
        if after_s:
            await asyncio.sleep(after_s)
            log.info("no client came back for %s: stopping it", flight.prompt.request_id,
                     extra=turn_fields(flight.prompt))
        if not flight.cancelled:
            flight.cancelled = True
            await self._abort(flight.prompt.request_id)
