"""The loop of a consumer that projects the log into PostgreSQL (``run_projection``): the
projector and the memory service run it; and the step every such consumer takes a batch
with (``until_taken``), the analytics' faust agent too.

Each round takes a batch of records (up to ``max_records``, gathered over a window),
hands it to the projection, and, while the database (or whatever the projection
names ``retryable``) refuses it, hands the same batch again after a backoff, waking
at once on stop: nothing polled is lost, and the projection catches up by itself once
the database is back. After each batch taken, the projection's periodic work runs
(offsets, lag metrics). A projection is called every round, with a batch possibly
empty, so work that must go on whether records come or not (positions moved past
transaction markers) has its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pipeline.kafka import GroupConsumer, Record
from pipeline.retry import Backoff

T = TypeVar("T")


class Stopped(Exception):
    """Stop was asked while a refused batch waited to be tried again."""


async def until_taken(step: Callable[[], Awaitable[T]],
                      retryable: tuple[type[BaseException], ...],
                      retrying: Callable[[BaseException, float], Awaitable[None]],
                      backoff: Backoff, stop: asyncio.Event | None = None) -> T:
    """What ``step`` gives once it raises none of ``retryable``. After each refusal,
    ``retrying(error, delay_s)`` is told (to log, count, drop a broken connection) and
    the step runs again after the backoff's next delay; ``Stopped`` as soon as ``stop``
    is set meanwhile. Any other error propagates."""
    while True:
        try:
            result = await step()
        except retryable as exc:
            delay = backoff.next()
            await retrying(exc, delay)
            if stop is None:
                await asyncio.sleep(delay)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                raise Stopped from None
            continue
        backoff.reset()
        return result


class Projection(Protocol):
    async def project_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        """Apply ``records`` (maybe none); raise a ``retryable`` error to have them
        applied again later."""

    async def after_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        """After ``records`` were applied: offsets, lag, what is periodic."""


@dataclass(frozen=True)
class Rounds:
    """How batches are taken (``AsyncConsumer.poll_window``) and retried."""

    max_records: int
    wait_s: float  # for a first record
    window_s: float  # then for more, up to max_records
    retry_min_s: float = 0.2
    retry_max_s: float = 10.0


async def run_projection(consumer: GroupConsumer, projection: Projection, rounds: Rounds,
                  stop: asyncio.Event, retryable: tuple[type[BaseException], ...],
                  retrying: Callable[[BaseException, int, float], None]) -> None:
    """Run ``projection`` over ``consumer``'s records until ``stop`` (see the module);
    ``retrying(error, records, delay_s)`` is told of each batch to be applied again."""
    backoff = Backoff(rounds.retry_min_s, rounds.retry_max_s)
    while not stop.is_set():
        records = await consumer.poll_window(rounds.max_records, rounds.wait_s,
                                             rounds.window_s)

        async def told(exc: BaseException, delay: float, polled: int = len(records)) -> None:
            retrying(exc, polled, delay)

        try:
            await until_taken(functools.partial(projection.project_batch, consumer, records),
                              retryable, told, backoff, stop)
        except Stopped:
            return
        await projection.after_batch(consumer, records)
