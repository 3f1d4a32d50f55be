"""Taking partitions over: what a worker handed prompt partitions reads before it runs
any of their prompts (on the consumer's thread, inside the rebalance).

* The prompts' committed offsets, where the partitions' ledgers and offsets start (a
  model's group the first time: at the model's first prompt).
* What earlier owners wrote for the turns not committed yet: the durable record's
  starts and ends, and the live stream's deltas (``workers.recovery`` folds them), from
  the oldest unfinished prompt of the worker's model on (another model's turns are its
  own workers' to resume: a model's first worker on an old log reads back only as far
  as its own prompts waiting, not to where the group's start is).
* The recent control events, so a turn cancelled or abandoned while its prompt waited is
  known before the prompt comes up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from pipeline.codec import TP, Codec, names_model, parse_or_none
from pipeline.kafka import (
    GroupConsumer,
    KafkaException,
    Record,
    first_records,
    group_committed,
    high_watermarks,
    scan_partitions,
)
from pipeline.retry import Backoff, QuietLog
from pipeline.topics import CLOCK_SKEW_MS, CONTROL, GENERATIONS, LIVE, PROMPTS, WORKERS_GROUP
from workers.control import ControlBook
from workers.flights import Flights
from workers.recovery import Found, LiveFolder, LogFolder

log = logging.getLogger(__name__)
_quiet = QuietLog(log)
T = TypeVar("T")


@dataclass(frozen=True)
class Handover:
    committed: dict[int, int]  # prompt partition -> its committed offset
    found: Found  # the unfinished turns earlier owners left, and their deltas
    control_ends: dict[int, int]  # control partition -> where reading goes on


def retrying(take: Callable[[], T], closing: Callable[[], bool] = lambda: False) -> T | None:
    """``take()``, retried with backoff while Kafka does not answer (a broker restarting
    makes it): a worker never exits for that. None once ``closing()``: the client it asks
    through is being closed (the worker stops), and nothing asked of it is answered."""
    backoff = Backoff(0.5, 10.0)
    while True:
        try:
            return take()
        except (KafkaException, TimeoutError) as exc:
            if closing():
                log.info("taking partitions over stopped: the worker's consumer closes")
                return None
            delay = backoff.next()
            _quiet.warning("could not take partitions over (retrying in %.1f s): %s",
                           delay, exc)
            time.sleep(delay)


def read_handover(bootstrap: str, consumer: GroupConsumer, prompts: list[int],
                  controls: list[int], book: ControlBook, running: Container[str], *,
                  codec: Codec, model: str, recovery_window_s: float,
                  transaction_timeout_ms: int) -> Handover:
    """What the new owner of ``prompts`` and ``controls``, a worker of ``model``, needs;
    the control events read go into ``book``; turns in ``running`` (already here) are left
    out. ``codec`` opens the text turns resume from."""
    # Prompts are read on from the committed offsets: the ledger and the offsets of each
    # transaction start there, and the scans below start at the oldest unfinished prompt
    # of the model past them.
    fresh: list[TP] = []

    def earlier(missing: list[TP]) -> dict[TP, int]:
        fresh.extend(missing)
        return group_committed(bootstrap, WORKERS_GROUP, missing)

    committed = consumer.committed_sync([(PROMPTS, p) for p in prompts], fallback=earlier)
    firsts, ends = oldest_prompts(bootstrap, committed, model)
    # A model's group the first time starts at the model's first prompt past where the
    # single group of earlier versions stopped (nothing that group ran runs again), else
    # past the partition's start; at the end if there is none: the prompts before are
    # other models', whose verdicts the ledger reads when a later prompt's history needs
    # them (``workers.ledger``). So a model added to an old log does not judge every
    # prompt since its start before it serves.
    for tp in fresh:
        first = firsts.get(tp[1])
        committed[tp] = first.position.offset if first is not None else ends[tp[1]]
    since = scan_starts(firsts, recovery_window_s)
    # What earlier owners wrote (committed, or resolved if still open: scan_partitions).
    # Open transactions of an earlier owner end within the transaction timeout.
    wait_s = max(60.0, 3 * transaction_timeout_ms / 1000)
    # Folded as they are read: a busy window holds millions of records. The ends, and the
    # deltas of turns written before the live stream, are in the durable record; the
    # deltas of the others, in the live stream.
    oldest = min(since.values(), default=0)
    durable = LogFolder()
    for record in reported(scan_partitions(bootstrap, GENERATIONS, list(since), since, wait_s),
                           oldest, f"reading {GENERATIONS}"):
        durable.add(record.value)
    live = LiveFolder({p: committed[(PROMPTS, p)] for p in since}, codec)
    for record in reported(scan_partitions(bootstrap, LIVE, list(since), since, wait_s),
                           oldest, f"reading {LIVE}"):
        live.add(record.position.partition, record.value)
    found = Found({rid: rec for rid, rec in durable.result().items() if rid not in running},
                  live.result())
    control_ends = high_watermarks(bootstrap, CONTROL, controls)
    for record in scan_partitions(bootstrap, CONTROL, [p for p in controls if p in since],
                                  since, wait_s, ends=control_ends):
        event = parse_or_none(record.value)  # ids only
        if event is not None:
            book.apply(event, logged_at(record))
    return Handover({p: o for (_, p), o in committed.items()}, found, control_ends)


class Owner(Protocol):
    """What a worker's rebalances change in the worker, and no more of it."""

    def took_over(self, handover: Handover, group: object) -> None:
        """Partitions handed over (``group``: the new generation, for its transactions)."""

    def give_up(self, partitions: list[int]) -> None:
        """Prompt partitions taken away: returns once their turns are abandoned."""


class Rebalances:
    """A worker's side of its group's rebalances (on the consumer's thread, inside a
    poll): partitions handed to it are taken over (``read_handover``), and the turns of
    those taken away are abandoned to their next owner."""

    def __init__(self, owner: Owner, bootstrap: str, consumer: GroupConsumer,
                 flights: Flights, codec: Codec, model: str, recovery_window_s: float,
                 transaction_timeout_ms: int) -> None:
        self.owner, self.bootstrap, self.consumer, self.flights = (
            owner, bootstrap, consumer, flights)
        self.codec, self.model = codec, model
        self.recovery_window_s = recovery_window_s
        self.transaction_timeout_ms = transaction_timeout_ms

    def on_assign(self, assigned: list[TP]) -> dict[TP, int] | None:
        """Take partitions over; where to read them from. None (nothing taken over): the
        consumer's close serves this callback, for a join still under way when the worker
        was asked to stop; a stop then hung, retrying on a client being destroyed."""
        if self.consumer.closing:
            return None
        return retrying(lambda: self._take_over(assigned), lambda: self.consumer.closing)

    def _take_over(self, assigned: list[TP]) -> dict[TP, int]:
        prompts = [p for t, p in assigned if t == PROMPTS]
        controls = [p for t, p in assigned if t == CONTROL]
        handover = read_handover(
            self.bootstrap, self.consumer, prompts, controls, self.flights.book,
            self.flights.running, codec=self.codec, model=self.model,
            recovery_window_s=self.recovery_window_s,
            transaction_timeout_ms=self.transaction_timeout_ms)
        self.owner.took_over(handover, self.consumer.group_metadata_sync())
        log.info("assigned prompts %s; recent: %s", prompts, handover.found.describe())
        return {**{(PROMPTS, p): o for p, o in handover.committed.items()},
                **{(CONTROL, p): o for p, o in handover.control_ends.items()}}

    def on_revoke(self, revoked: list[TP]) -> None:
        self.owner.give_up([p for t, p in revoked if t == PROMPTS])


def oldest_prompts(bootstrap: str, committed: dict[TP, int], model: str
                   ) -> tuple[dict[int, Record], dict[int, int]]:
    """Per prompt partition, the oldest prompt of ``model`` past its committed offset
    (none: no turn of the model there is unfinished), and each partition's end, below
    which every prompt was read (an open transaction's is waited for)."""
    ends = high_watermarks(bootstrap, PROMPTS, [p for _, p in committed])
    spans = {p: (o, ends[p]) for (_, p), o in committed.items() if o < ends[p]}
    return first_records(bootstrap, PROMPTS, spans,
                         wanted=lambda record: names_model(record.value, model)), ends


def scan_starts(oldest: dict[int, Record], recovery_window_s: float) -> dict[int, int]:
    """Per prompt partition with an unfinished prompt of the worker's model (``oldest``:
    the oldest of them, ``oldest_prompts``), the time to scan from: that prompt's (what
    its turn and later ones wrote came after it), less clock skew, however long ago: a
    turn whose history was read in part would run again from its start, under seqs its
    readers have seen (and one whose clients left would run on). A partition with none
    needs no scan: every turn of the model before its committed offset has ended, and
    another model's turns are its own workers' to resume. Past the recovery window, the
    reading is logged."""
    starts = {p: record.timestamp_ms - CLOCK_SKEW_MS for p, record in oldest.items()}
    now_ms = int(time.time() * 1000)
    back_ms = now_ms - min(starts.values(), default=now_ms)
    if back_ms > (recovery_window_s * 1000) + CLOCK_SKEW_MS:
        log.warning("taking over: reading %s back %.0f s, to the oldest unfinished prompt "
                    "(past the %.0f s recovery window)", GENERATIONS, back_ms / 1000,
                    recovery_window_s)
    return starts


def reported(records: Iterable[Record], since_ms: int, what: str,
             every_s: float = 10.0) -> Iterator[Record]:
    """``records`` (written from ``since_ms`` on), with a line logged every ``every_s``
    of a long read: how many so far, and how far through the time they span."""
    started = last = time.monotonic()
    span_ms = max(time.time() * 1000 - since_ms, 1.0)
    for count, record in enumerate(records, 1):
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            done = min(max((record.timestamp_ms - since_ms) / span_ms, 0.0), 1.0)
            log.info("taking over: %s: %d records in %.0f s, %.0f%% of the way to now",
                     what, count, now - started, 100 * done)
        yield record


def logged_at(record: Record) -> datetime | None:
    """When the log appended ``record`` (its timestamp on a ``LogAppendTime`` topic)."""
    return datetime.fromtimestamp(record.timestamp_ms / 1000, UTC) \
        if record.timestamp_ms > 0 else None
