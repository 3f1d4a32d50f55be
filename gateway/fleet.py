"""What a gateway knows of the workers, read from their consumer group in Kafka, so no
gateway needs state shared with another.

* **Backlog**: the group's lag on ``chat.prompts``, i.e. prompts accepted but not
  finished (workers commit the low watermark of their in-flight prompts, so running
  turns count until they end). ``admit()`` refuses new turns with 429 past the bound;
  ``Retry-After`` is how long the workers take, at the rate they have been finishing
  prompts, to bring the backlog back under it.
* **Models**: those the live workers serve, from their heartbeats (``pipeline.roster``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from gateway.problems import BacklogFull
from pipeline.kafka import GroupStatus
from pipeline.retry import QuietLog
from pipeline.roster import Roster
from pipeline.topics import PROMPTS, WORKERS_GROUP

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, bootstrap: str, max_backlog: int, interval_s: float = 0.25) -> None:
        self.max_backlog = max_backlog
        self.interval_s = interval_s
        self.backlog = 0
        self.drain_per_s = 0.0  # prompts finished per second, smoothed
        self.models: set[str] = set()  # served by live workers
        self._group = GroupStatus(bootstrap, WORKERS_GROUP)
        self._roster = Roster(bootstrap)
        self._task: asyncio.Task[None] | None = None
        self._quiet = QuietLog(log)

    def admit(self) -> None:
        """Refuse (``BacklogFull``) while the workers' backlog is over the bound."""
        excess = self.backlog - self.max_backlog
        if excess < 0:
            return
        wait = math.ceil((excess + 1) / self.drain_per_s) if self.drain_per_s > 0 else 5
        wait = min(max(wait, 1), 60)
        raise BacklogFull(self.backlog, self.max_backlog, wait)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet")

    async def _run(self) -> None:
        last: tuple[float, int] | None = None
        while True:
            try:
                self.models = await asyncio.to_thread(self._roster.refresh)
            except Exception as exc:
                self._quiet.warning("could not read the workers' heartbeats: %s", exc)
            try:
                lag = await asyncio.to_thread(self._group.per_partition, PROMPTS)
                self.backlog = sum(max(end - committed, 0) for committed, end in lag.values())
                now, done = time.monotonic(), sum(c for c, _ in lag.values())
                if last is not None and now > last[0]:
                    rate = max(done - last[1], 0) / (now - last[0])
                    self.drain_per_s = 0.8 * self.drain_per_s + 0.2 * rate
                last = (now, done)
            except Exception as exc:
                self._quiet.warning("could not read the workers' group: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self._group.close)
        await asyncio.to_thread(self._roster.close)
