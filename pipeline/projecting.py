"""The loop of a consumer that projects the log into PostgreSQL (``run_projection``): the
projector and the memory service run it.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pipeline.kafka import AsyncConsumer, Record
from pipeline.retry import Backoff


class Projection(Protocol):
    async def project_batch(self, consumer: AsyncConsumer, records: list[Record]) -> None:
        """Apply ``records`` (maybe none); raise a ``retryable`` error to have them
        applied again later."""

    async def after_batch(self, consumer: AsyncConsumer, records: list[Record]) -> None:
        """After ``records`` were applied: offsets, lag, what is periodic."""


@dataclass(frozen=True)
class Rounds:
    """How batches are taken (``AsyncConsumer.poll_window``) and retried."""

    max_records: int
    wait_s: float  # for a first record
    window_s: float  # then for more, up to max_records
    retry_min_s: float = 0.2
    retry_max_s: float = 10.0


async def run_projection(consumer: AsyncConsumer, projection: Projection, rounds: Rounds,
                  stop: asyncio.Event, retryable: tuple[type[BaseException], ...],
                  retrying: Callable[[BaseException, int, float], None]) -> None:
    """Run ``projection`` over ``consumer``'s records until ``stop`` (see the module);
    ``retrying(error, records, delay_s)`` is told of each batch to be applied again."""
    backoff = Backoff(rounds.retry_min_s, rounds.retry_max_s)
    records: list[Record] = []  # polled, not yet applied
    while not stop.is_set():
        if not records:
            records = await consumer.poll_window(rounds.max_records, rounds.wait_s,
                                                 rounds.window_s)
        try:
            await projection.project_batch(consumer, records)
        except retryable as exc:
            delay = backoff.next()
            retrying(exc, len(records), delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            continue
        backoff.reset()
        done, records = records, []
        await projection.after_batch(consumer, done)
