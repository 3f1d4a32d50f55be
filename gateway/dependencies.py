"""The gateway's two dependencies, Kafka and PostgreSQL: every call to either is bounded
in time, and its failure becomes a refusal (503 with ``Retry-After``), never a 500 or a
hang. ``Health`` checks both in the background for ``/readyz``.

Once a call to one has failed for want of an answer, its ``Breaker`` opens: later calls
are refused at once, without waiting for a timeout, until ``Health``'s probe sees the
dependency answer again. Thousands of clients retrying against a database that is down
then hold no connection and no task each for the length of a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from gateway.problems import LogUnavailable, StoreUnavailable
from pipeline.kafka import KafkaException, LogReader, ProduceError, stale_leader, unreachable
from pipeline.retry import QuietLog
from pipeline.topics import PROMPTS

log = logging.getLogger(__name__)
T = TypeVar("T")
_quiet = QuietLog(log)
# What the database raises when it, or the way to it, is gone (a query's own errors, a
# bad value say, are not among them: they stay errors of this program).
DATABASE_AWAY = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)
# How long a call refused by a partition's former leader waits to be asked again.
STALE_LEADER_RETRY_S = 0.1


class Breaker:
    """Whether calls to a dependency may be tried (see the module)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.open_since: float | None = None

    @property
    def open(self) -> bool:
        return self.open_since is not None

    def trip(self, why: object) -> None:
        if self.open_since is None:
            log.warning("%s is down (%s): its calls are refused at once until a probe "
                        "sees it answer", self.name, why)
            self.open_since = time.monotonic()

    def close(self) -> None:
        if self.open_since is not None:
            log.warning("%s answers again after %.1f s", self.name,
                        time.monotonic() - self.open_since)
            self.open_since = None


# One of each per process: every app of a process shares its dependencies' fate.
KAFKA = Breaker("kafka")
POSTGRES = Breaker("postgres")

async def from_log(call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """The result of a call to Kafka (made by ``call()``), or ``LogUnavailable`` after
    ``timeout_s``, or at once while Kafka is known to be down."""
    if KAFKA.open:
        raise LogUnavailable()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    return await call()
                except KafkaException as exc:
                    if not stale_leader(exc):
                        raise
                    # A leader moved (a broker paused or restarted): refused before
                    # anything was done, and answered once the client knows the new one.
                    _quiet.warning("Kafka's leadership moved under a call; asking again: "
                                   "%r", exc)
                    await asyncio.sleep(STALE_LEADER_RETRY_S)
    except TimeoutError as exc:
        KAFKA.trip(f"no answer within {timeout_s:g} s")
        raise LogUnavailable() from exc
    except (KafkaException, ProduceError) as exc:
        _quiet.warning("Kafka did not answer: %r", exc)
        if unreachable(exc):
            KAFKA.trip(exc.args[0])
        raise LogUnavailable() from exc


@contextlib.asynccontextmanager
async def from_store(pool: AsyncConnectionPool, timeout_s: float, *, probe: bool = False
                     ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection for one short use, all of it within ``timeout_s``; ``StoreUnavailable``
    if the database is away or does not answer, at once while it is known to be (unless
    this is the ``probe`` that finds out whether it is back)."""
    if POSTGRES.open and not probe:
        raise StoreUnavailable()
    try:
        async with asyncio.timeout(timeout_s), pool.connection(timeout=timeout_s) as conn:
            yield conn
    except (*DATABASE_AWAY, TimeoutError) as exc:
        _quiet.warning("PostgreSQL did not answer: %r", exc)
        POSTGRES.trip(exc)
        raise StoreUnavailable() from exc


class Health:
    """Whether Kafka and PostgreSQL answer, checked every ``every_s`` (never on a request's
    path): what ``/readyz`` reports, by name."""

    def __init__(self, meta: LogReader, pool: AsyncConnectionPool, timeout_s: float,
                 every_s: float = 2.0) -> None:
        self.meta = meta
        self.pool = pool
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.down: dict[str, str] = {}
        self.checked_at = 0.0
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> dict[str, str]:
        down = {}
        try:
            await asyncio.wait_for(self.meta.partitions(PROMPTS,
                                                  self.timeout_s), self.timeout_s)
        except Exception as exc:  # whatever it is, Kafka did not answer
            down["kafka"] = self._why(exc)
            KAFKA.trip(down["kafka"])
        else:
            KAFKA.close()
        try:
            async with from_store(self.pool, self.timeout_s, probe=True) as conn:
                await conn.execute("SELECT 1")
        except StoreUnavailable as exc:
            down["postgres"] = self._why(exc.__cause__)
        else:
            POSTGRES.close()
        if down != self.down:
            log.warning("dependencies %s", f"down: {down}" if down else "all back")
        self.down, self.checked_at = down, time.monotonic()
        return down

    def _why(self, exc: BaseException | None) -> str:
        if exc is None or isinstance(exc, TimeoutError):
            return f"no answer within {self.timeout_s:g} s"
        return f"{type(exc).__name__}: {exc}"[:200]

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health")

    async def _run(self) -> None:
        while True:
            await self.check()
            # Sooner while a breaker is open: its dependency's callers wait for the probe.
            every = self.every_s / 4 if KAFKA.open or POSTGRES.open else self.every_s
            await asyncio.sleep(every)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
