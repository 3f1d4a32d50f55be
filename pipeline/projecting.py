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
    """Stop was asked while a refused batch waited to be tried again, or while a step
    did not end within ``STOP_GRACE_S`` of it."""


# How long a step under way may go on after stop is asked before it is cancelled: a
# batch that is being applied ends in that time; one waiting for what is away (a key
# while Kafka is, which its decoding asks for again until it can) would wait forever,
# and its process with it. Its records are polled again by whoever takes them next.
STOP_GRACE_S = 5.0


async def until_taken(step: Callable[[], Awaitable[T]],
                      retryable: tuple[type[BaseException], ...],
                      retrying: Callable[[BaseException, float], Awaitable[None]],
                      backoff: Backoff, stop: asyncio.Event | None = None,
                      grace_s: float = STOP_GRACE_S) -> T:
    """What ``step`` gives once it raises none of ``retryable``. After each refusal,
    ``retrying(error, delay_s)`` is told (to log, count, drop a broken connection) and
    the step runs again after the backoff's next delay; ``Stopped`` as soon as ``stop``
    is set meanwhile, or ``grace_s`` after it if a step under way has not ended. Any
    other error propagates."""
    while True:
        try:
            result = await (step() if stop is None else _unless_stopped(step, stop, grace_s))
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


async def _unless_stopped(step: Callable[[], Awaitable[T]], stop: asyncio.Event,
                          grace_s: float) -> T:
    """What ``step`` gives; ``Stopped`` (the step cancelled) if it has not ended
    ``grace_s`` after ``stop`` is set."""
    task = asyncio.ensure_future(step())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise Stopped
        return task.result()
    finally:
        stopping.cancel()
        task.cancel()  # the caller cancelled: so is the step


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
