"""What a gateway knows of the workers, read from their consumer group in Kafka, so no
gateway needs state shared with another.

* **Backlog**, per model: the prompts waiting for its workers, i.e. accepted and not
  started (``pipeline.waiting``: what the workers' commits say, the part of
  ``chat.prompts`` they have not read and what they read but have not started; a
  running turn does not count, however long it runs). ``admit(model)`` refuses new
  turns with 429 past the bound; ``Retry-After`` is how long the workers take, at the
  rate they have been starting prompts, to bring the backlog back under it. A group
  that never committed (its workers not started yet) counts as caught up; one whose
  commits say nothing of what waits (workers of an earlier version) counts every
  prompt past its committed offset. A model this gateway admitted a turn for within
  ``BUSY_S`` is measured every ``interval_s``; any other every ``IDLE_INTERVAL_S``,
  and again at once when a turn for it is admitted: a gateway with nothing to do asks
  the broker next to nothing, and its first admission after a pause is judged on a
  figure at most ``IDLE_INTERVAL_S`` old (the bound is a soft one anyway: every
  gateway admits on its own figure).
* **Models**: those the live workers serve, from their heartbeats (``pipeline.roster``),
  and those served within the hour (``known``).
* **Aliases**: which version serves each model alias, and any rollout under way
  (``schemas.rollout``); ``route()`` picks a new turn's version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass

from gateway.problems import BacklogFull, TenantLimit
from pipeline.kafka import GroupStatus
from pipeline.retry import QuietLog
from pipeline.rollout import RolloutBook
from pipeline.roster import Roster
from pipeline.topics import PROMPTS, workers_group
from pipeline.waiting import waiting
from schemas.rollout import Rollout, route

log = logging.getLogger(__name__)
# A model this gateway has admitted no turn for in ``BUSY_S`` has its backlog measured
# every ``IDLE_INTERVAL_S`` instead of every ``interval_s``.
BUSY_S = 30.0
IDLE_INTERVAL_S = 5.0


@dataclass
class _Backlog:
    group: GroupStatus
    prompts: int = 0
    drain_per_s: float = 0.0  # prompts finished per second, smoothed
    last: tuple[float, int] | None = None  # when measured (monotonic), prompts finished
    admitted_at: float = -math.inf  # when this gateway last admitted a turn for it

    def busy(self, now: float) -> bool:
        """Whether this gateway admitted a turn for it within ``BUSY_S``."""
        return now - self.admitted_at < BUSY_S

    def due(self, now: float, interval_s: float) -> bool:
        """Whether to measure it now (see the module). A tenth of the interval is given
        up, so that the loop's own wait of ``interval_s`` never makes it skip one."""
        if self.last is None:
            return True
        every = interval_s if self.busy(now) else IDLE_INTERVAL_S
        return now - self.last[0] >= every * 0.9


class Fleet:
    def __init__(self, bootstrap: str, max_backlog: int, interval_s: float = 0.25,
                 configured: list[str] | None = None, max_waiting_per_tenant: int | None = None,
                 max_running_per_tenant: int | None = None) -> None:
        self.bootstrap = bootstrap
        self.max_backlog = max_backlog
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_running_per_tenant = max_running_per_tenant
        self.interval_s = interval_s
        self.configured = list(configured or [])
        self.models: set[str] = set()  # served by live workers
        self.known: set[str] = set()  # served within the hour
        self._backlogs: dict[str, _Backlog] = {}
        self.rollouts: dict[str, Rollout] = {}  # the latest record per alias
        self._roster = Roster(bootstrap)
        self._book = RolloutBook(bootstrap)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # a turn was admitted for a model measured seldom
        self._quiet = QuietLog(log)

    @property
    def backlog(self) -> int:
        """The largest model's backlog (the gauge)."""
        return max((b.prompts for b in self._backlogs.values()), default=0)

    def limits(self, model: str) -> tuple[int, int] | None:
        """``model``'s context length and the most bytes one of its tokens stands for, as
        its live workers say (None: unknown)."""
        return self._roster.limits(model)

    def route(self, model: str, conversation_id: uuid.UUID) -> tuple[str, Rollout | None]:
        """The version that serves a new turn of ``conversation_id`` asked for ``model``,
        and the alias record that decided it (None: ``model`` is no alias)."""
        return route(self.rollouts, model, conversation_id, self.models)

    @property
    def aliases(self) -> set[str]:
        """Aliases whose version is served now (for ``/v1/models``)."""
        return {a for a, r in self.rollouts.items() if r.stable in self.models}

    def admit(self, model: str, tenant: str) -> None:
        """Refuse ``tenant``'s new turn while it has as many turns waiting or running for
        ``model`` as its caps allow (``TenantLimit``; as the workers' heartbeats said, at
        most a few seconds ago), or while ``model``'s backlog is over the bound
        (``BacklogFull``)."""
        waiting, running = self._roster.tenant_load(model, tenant)
        for count, cap, what, setting in (
                (waiting, self.max_waiting_per_tenant, "waiting prompts",
                 "GATEWAY_MAX_WAITING_PER_TENANT"),
                (running, self.max_running_per_tenant, "running turns",
                 "GATEWAY_MAX_RUNNING_PER_TENANT")):
            if cap is not None and count >= cap:
                raise TenantLimit(what, count, cap, setting)
        backlog = self._backlogs.get(model)
        if backlog is None:
            return
        now = time.monotonic()
        if not backlog.busy(now):
            self._wake.set()  # measured seldom until now: measured again at once
        backlog.admitted_at = now
        excess = backlog.prompts - self.max_backlog
        if excess < 0:
            return
        wait = math.ceil((excess + 1) / backlog.drain_per_s) if backlog.drain_per_s > 0 else 5
        wait = min(max(wait, 1), 60)
        raise BacklogFull(backlog.prompts, self.max_backlog, wait)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet")

    async def _run(self) -> None:
        while True:
            try:
                self.models = await asyncio.to_thread(self._roster.refresh)
                self.known = self._roster.known | self.models
            except Exception as exc:
                self._quiet.warning("could not read the workers' heartbeats: %s", exc)
            try:
                self.rollouts = await asyncio.to_thread(self._book.refresh)
            except Exception as exc:
                self._quiet.warning("could not read the model aliases: %s", exc)
            wanted = self.models | set(self.configured)
            for model in [m for m in self._backlogs if m not in wanted]:
                # Gone (an old version, say): its turns are refused, so nothing to admit.
                await asyncio.to_thread(self._backlogs.pop(model).group.close)
            for model in sorted(wanted):
                if model not in self._backlogs:
                    self._backlogs[model] = _Backlog(GroupStatus(self.bootstrap,
                                                                 workers_group(model)))
                if not self._backlogs[model].due(time.monotonic(), self.interval_s):
                    continue
                try:
                    await asyncio.to_thread(self._measure, self._backlogs[model])
                except Exception as exc:
                    self._quiet.warning("could not read the workers' group of %s: %s",
                                        model, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()

    @staticmethod
    def _measure(backlog: _Backlog) -> None:
        told = [waiting(committed, end, metadata) for committed, end, metadata in
                backlog.group.committed_and_ends(PROMPTS, uncommitted_at_end=True).values()]
        backlog.prompts = sum(w for w, _ in told)
        now, done = time.monotonic(), sum(d for _, d in told)
        if backlog.last is not None and now > backlog.last[0]:
            rate = max(done - backlog.last[1], 0) / (now - backlog.last[0])
            backlog.drain_per_s = 0.8 * backlog.drain_per_s + 0.2 * rate
        backlog.last = (now, done)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for backlog in self._backlogs.values():
            await asyncio.to_thread(backlog.group.close)
        await asyncio.to_thread(self._roster.close)
        await asyncio.to_thread(self._book.close)
