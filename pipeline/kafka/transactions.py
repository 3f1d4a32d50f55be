"""``TransactionalProducer``: records written in Kafka transactions, with the reading
group's offsets, fenced by the transactional id's epoch (guarantee 9).

It has three parts: the records queued for the next transaction, with their epochs and
backpressure (``outbox``); the thread that makes the transactions (``transaction_loop``);
and the watchdog over deadlines and stuck transactions (``watchdog``). The class below
is what senders see of them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.codec import TP, Position, bare, key_of
from pipeline.kafka.client import NO_NAGLE, RECORD_OVERHEAD, Outgoing, client_config, client_logging
from pipeline.kafka.outbox import Outbox, Pacing, Queued, RecordLimits
from pipeline.kafka.transaction_loop import TransactionLoop
from pipeline.kafka.watchdog import Watchdog
from schemas import Event


@dataclass(frozen=True)
class TransactionSettings:
    """A ``TransactionalProducer``'s settings (see it): the transaction timeout; whether
    its transactional id is its process's own (a fenced producer then takes it up again);
    transactions' spacing, and whether the sender says when a step is ``gathered``; the
    records queued before ``room()`` waits; the largest record by default and per topic
    (``limits``: a topic's ``max.message.bytes``); the compression."""

    timeout_ms: int = 10_000
    own_id: bool = True
    interval_ms: float = 0.0
    gathers: bool = False
    max_queued: int = 20_000
    max_record_bytes: int = 8 * 2**20
    limits: tuple[tuple[str, int], ...] = ()
    compression: str = "zstd"


class TransactionalProducer:
    """Produces in Kafka transactions; a record is visible to read_committed readers only
    once its transaction commits, and never if it aborts.

    One thread commits transactions back to back. Each takes everything queued, produces
    it, waits until the broker holds all of it, then (for a consumer's output: ``offsets``
    given) sends the consumer's offsets with its group metadata, and commits. The group
    check (KIP-447) refuses a member that has left the group: a worker that was paused or
    cut off while its partitions moved on writes nothing a reader sees. Records reach the
    log before that check, so a transaction that passes it and commits later (its
    process paused in between) holds nothing a new owner's scan up to the high
    watermark misses.

    Every answer is definite. ``send`` resolves with the record's position once its
    transaction committed, or fails once it is certain the record never will be: its
    transaction aborted, or its ``deadline`` passed before that transaction asked to
    commit (``NotAccepted``, answered within 50 ms of the deadline however the brokers
    behave: the transaction is then doomed, and whichever ends it, this producer's
    abort, a new producer under the id, or the coordinator's transaction timeout, ends
    it in an abort). Once a commit was asked for, the answer waits for the broker's: a
    commit whose answer was lost is asked again until the broker says; a transaction
    that failed for a passing reason is aborted and its records sent again (aborted
    records are never visible, so each is written once); one refused for ownership is
    dropped (``Fenced``) and ``on_fenced`` is called, with whether an assignment answers
    the refusal (one under way, or one made since that transaction's) and the group
    metadata that transaction showed. A producer fenced by its epoch (Kafka 4 bumps it
    when it ends a transaction itself) is replaced, and its records are sent again: if
    that transaction was a commit whose answer was lost, which had happened, the log
    holds a copy, which every reader drops.

    Transactions are spaced ``interval_ms`` apart at least (counted from one's begin to
    the next's), so that more records share each one's fixed cost. A sender that
    ``gathers`` also says, with ``gathered``, when what it has to write for now is all
    queued (a worker: an engine step's deltas); a transaction then waits for that, though
    never past ``interval_ms`` after its first record was queued, rather than taking part
    of a step and leaving the rest a whole interval for the next.

    Records carry the ``epoch`` they were queued in: ``new_epoch`` (on revocation or
    fencing) drops every record of older epochs, so nothing written for turns this
    process gave up can reach the log after it gave them up.

    A step before the commit that has not returned within the transaction timeout is
    stuck, not slow: librdkafka's ``send_offsets_to_transaction`` ignores its timeout
    and can wait forever for a group coordinator that left the metadata (librdkafka
    #5456 and #5511, open in 2.16; seen here after every broker was restarted). No call
    can interrupt it, so the watchdog replaces the producer: a new one under the same id
    fences the stuck one and aborts its transaction (the coordinator has aborted it by
    then anyway), the transaction's records are sent again on a new thread, and the
    stuck thread, if its call ever returns, touches nothing. The calls with a timeout of
    their own (registering the id, committing, aborting) are watched the same way: one
    not returned a transaction timeout past its own timeout is stuck (a commit replaced
    so may have happened: readers drop the copies its records' second sending makes).
    """

    def __init__(
        self, bootstrap: str, transactional_id: str,
        settings: TransactionSettings = TransactionSettings(),
        offsets: Callable[[], dict[TP, int]] | None = None, *,
        on_committed: Callable[[dict[TP, int]], None] = lambda _o: None,
        on_fenced: Callable[[bool, Any], None] = lambda _answered, _group: None,
        offset_metadata: Callable[[TP], str] | None = None,
    ) -> None:
        config = {
            **client_config(bootstrap, "transactions"),
            "compression.type": settings.compression,
            "transactional.id": transactional_id,
            "transaction.timeout.ms": settings.timeout_ms,
            "linger.ms": 1,
            "message.max.bytes": settings.max_record_bytes + RECORD_OVERHEAD,
            "partitioner": "murmur2_random",
            # A transaction begun right after the previous one's commit is refused with
            # CONCURRENT_TRANSACTIONS until the broker has written that one's markers; the
            # client retries after retry.backoff.ms, growing to retry.backoff.max.ms
            # (measured: every transaction took 104 ms at the default 100 ms, 8 ms at 2 ms;
            # under load a 500 ms cap let retries grow to tens of ms).
            "retry.backoff.ms": 2,
            "retry.backoff.max.ms": 10,
            **client_logging("transactions"),
            **NO_NAGLE,
        }
        self._outbox = Outbox(RecordLimits(settings.max_record_bytes, dict(settings.limits)),
                              Pacing(settings.interval_ms / 1000, settings.gathers),
                              settings.max_queued)
        self._loop = TransactionLoop(config, self._outbox, settings.timeout_ms / 1000,
                                     settings.own_id, offsets, offset_metadata,
                                     on_committed, on_fenced)
        self._watchdog = Watchdog(self._outbox, self._loop)
        self.ready = self._loop.ready  # set once the transactional id is registered

    @property
    def epoch(self) -> int:
        return self._outbox.epoch

    @property
    def failed(self) -> BaseException | None:
        """Why the producer failed for good (a shared id taken over), or None."""
        return self._outbox.failed

    @property
    def transactions(self) -> int:
        """Transactions committed."""
        return self._loop.transactions

    @property
    def broker_clock_ahead_s(self) -> float:
        """The brokers' clock less this host's, read off this producer's deliveries."""
        return self._loop.clock.ahead_s

    def start(self) -> None:
        """Start the transaction loop, which registers the transactional id (fencing an
        earlier process that used it; retried until the broker answers) and then
        commits, and the watchdog."""
        self._loop.start()
        self._watchdog.start()

    def send(self, topic: str, event: Event, epoch: int = 0, deadline: float | None = None,
             headers: Sequence[tuple[str, bytes]] = ()) -> asyncio.Future[Position]:
        """Queue ``event``; the future resolves with its position once its transaction
        committed (see the class). An event with content is encoded by the writer's
        codec and sent with ``send_raw`` (``pipeline.codec.bare``)."""
        return self.send_raw(topic, key_of(event), bare(event), headers, epoch, deadline)

    def send_nowait(self, topic: str, event: Event, epoch: int = 0,
                    key: bytes | None = None) -> None:
        """Queue ``event`` with no answer (its turn's terminal event is awaited instead);
        ``key``: its record key if the caller has it (``key_of(event)`` otherwise)."""
        self._outbox.put([Queued(epoch, topic, key or key_of(event), bare(event), [], None)])

    def send_raw(self, topic: str, key: bytes | None, value: bytes | None,
                 headers: Sequence[tuple[str, bytes]], epoch: int = 0,
                 deadline: float | None = None) -> asyncio.Future[Position]:
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        self._outbox.put([Queued(epoch, topic, key, value, list(headers), future, deadline)])
        return future

    def send_together(self, records: Sequence[Outgoing], epoch: int = 0
                      ) -> list[asyncio.Future[Position] | None]:
        """Queue ``records`` so that one transaction holds them all: none is visible
        without the others. Each that wants an answer (``Outgoing.answer``) gets a future,
        as ``send`` gives."""
        loop = asyncio.get_running_loop()
        items = [Queued(epoch, r.topic, r.key, r.value, [],
                        loop.create_future() if r.answer else None, partition=r.partition)
                 for r in records]
        self._outbox.put(items)
        return [item.future for item in items]

    def limit(self, topic: str) -> int:
        """The largest record (key, value and headers) ``topic`` takes from this producer."""
        return self._outbox.limits.record(topic)

    def topic_limit(self, topic: str) -> int:
        """``topic``'s own limit (its max.message.bytes), batch overhead included."""
        return self._outbox.limits.of(topic)

    def gathered(self) -> None:
        """What the sender has to write for now is queued (see ``gathers``)."""
        self._outbox.gathered()

    def begins_in(self) -> float | None:
        """How long before a transaction may take a record queued now: None while one is
        being made (``when_free`` says when it is over), else what is left of the spacing
        since the latest began (0: at once). A sender that gathers may hold its records
        meanwhile and add to them: they would wait as long in the queue."""
        return self._outbox.begins_in()

    def when_free(self, callback: Callable[[], None]) -> bool:
        """Have ``callback`` called on the running event loop once the transaction being
        made is over (or the producer stops); False, and no call, if none is being made."""
        return self._outbox.when_free(callback)

    @property
    def backlogged(self) -> bool:
        """More records queued than ``max_queued`` (the log takes them slower than they
        come): a sender that can wait should (``room``)."""
        return self._outbox.backlogged

    async def room(self) -> None:
        """Wait until the queue is under its bound: the next transaction took what waited,
        or it was dropped. A worker's turns wait here instead of queueing tokens without
        end while Kafka is slow; the engine merges what they have not read meanwhile."""
        await self._outbox.room()

    def congested(self) -> Awaitable[None] | None:
        """``room()`` while backlogged, else None: what an engine's step loop waits on
        (``workers.engine.Pace``), so that a worker whose log is slow lets its engine's
        outputs merge rather than queue without end."""
        return self.room() if self._outbox.backlogged else None

    @property
    def group(self) -> Any:
        """The group metadata transactions now show (``set_group``)."""
        return self._loop.group

    def set_group(self, metadata: Any) -> None:
        """The consumer's group metadata, as read after its latest assignment: what each
        transaction shows the broker (a stale one is refused)."""
        self._loop.group = metadata

    def commit_offsets(self, unless_within_s: float = 0.0) -> None:
        """Commit the offsets now even if nothing is queued (turns that ended since the
        last transaction, prompts that were skipped): unless a transaction began within
        ``unless_within_s`` (every transaction commits the offsets as they then are)."""
        self._outbox.want_commit(unless_within_s)

    def new_epoch(self) -> int:
        """Drop every record not yet in a transaction; later ones need the new epoch."""
        return self._outbox.new_epoch()

    def flush_sync(self, timeout: float) -> bool:
        """Block until everything queued so far has been committed or dropped."""
        return self._outbox.flush_sync(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush_sync(timeout)
        self._outbox.stop()
        self._loop.join(timeout)
