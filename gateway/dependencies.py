"""The gateway's two dependencies, Kafka and PostgreSQL: every call to either is bounded
in time, and its failure becomes a refusal (503 with ``Retry-After``), never a 500 or a
hang. ``Health`` checks both in the background for ``/readyz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from gateway.problems import LogUnavailable, StoreUnavailable
from pipeline.kafka import AsyncConsumer, KafkaException, ProduceError
from pipeline.retry import QuietLog
from pipeline.topics import PROMPTS

log = logging.getLogger(__name__)
T = TypeVar("T")
_quiet = QuietLog(log)
# What the database raises when it, or the way to it, is gone (a query's own errors, a
# bad value say, are not among them: they stay errors of this program).
DATABASE_AWAY = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)


async def from_log(call: Awaitable[T], timeout_s: float) -> T:
    """The result of a call to Kafka, or ``LogUnavailable`` after ``timeout_s``."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except (KafkaException, ProduceError, TimeoutError) as exc:
        _quiet.warning("Kafka did not answer: %r", exc)
        raise LogUnavailable() from exc


@contextlib.asynccontextmanager
async def from_store(pool: AsyncConnectionPool, timeout_s: float
                     ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection for one short use, all of it within ``timeout_s``; ``StoreUnavailable``
    if the database is away or does not answer."""
    try:
        async with asyncio.timeout(timeout_s), pool.connection(timeout=timeout_s) as conn:
            yield conn
    except (*DATABASE_AWAY, TimeoutError) as exc:
        _quiet.warning("PostgreSQL did not answer: %r", exc)
        raise StoreUnavailable() from exc


class Health:
    """Whether Kafka and PostgreSQL answer, checked every ``every_s`` (never on a request's
    path): what ``/readyz`` reports, by name."""

    def __init__(self, meta: AsyncConsumer, pool: AsyncConnectionPool, timeout_s: float,
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
            await asyncio.wait_for(self.meta.call(self.meta.partitions_sync, PROMPTS,
                                                  self.timeout_s), self.timeout_s)
        except Exception as exc:  # whatever it is, Kafka did not answer
            down["kafka"] = self._why(exc)
        try:
            async with from_store(self.pool, self.timeout_s) as conn:
                await conn.execute("SELECT 1")
        except StoreUnavailable as exc:
            down["postgres"] = self._why(exc.__cause__)
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
            await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
