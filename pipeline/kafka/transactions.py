"""``TransactionalProducer``: records written in Kafka transactions, with the reading
group's offsets, fenced by the transactional id's epoch (guarantee 9)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from pipeline.codec import TP, Position, encode, key_of
from pipeline.kafka.client import (
    NO_NAGLE,
    RECORD_OVERHEAD,
    Fenced,
    Outgoing,
    ProduceError,
    RecordTooLarge,
    client_config,
    client_logging,
    resolve,
)
from pipeline.retry import Backoff, QuietLog
from schemas import Event

log = logging.getLogger(__name__)

# Errors with which the group coordinator refuses a transaction's offsets (KIP-447):
# this member's generation is over, its partitions are (or are about to be) elsewhere.
_GROUP_FENCING = {KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID,
                  KafkaError.FENCED_INSTANCE_ID, KafkaError.REBALANCE_IN_PROGRESS,
                  KafkaError.STALE_MEMBER_EPOCH}
# The transaction coordinator refusing this producer's epoch: another producer took the
# transactional id, or the coordinator aborted a transaction that outlived its timeout
# (Kafka 4's transactions bump the epoch then). Fatal for this producer instance.
_PRODUCER_FENCING = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                     KafkaError.INVALID_PRODUCER_EPOCH}


@dataclass
class _Queued:
    epoch: int
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]
    future: asyncio.Future[Position] | None
    deadline: float | None = None  # time.monotonic(): answered NotAccepted after this
    partition: int | None = None  # None: the key's
    position: Position | None = None  # where it landed (set by its delivery report)
    settled: bool = False  # its sender has had the answer
    refused: KafkaError | None = None  # the broker refused this record itself (its size)

    def late(self, now: float) -> bool:
        return self.deadline is not None and self.deadline < now and not self.settled

    @property
    def size(self) -> int:
        """Its bytes as a record limit counts them (less the batch's own overhead)."""
        return (len(self.value or b"") + len(self.key or b"")
                + sum(len(k) + len(v or b"") for k, v in self.headers))


class NotAccepted(ProduceError):
    """A record whose deadline passed before its transaction asked to commit: that
    transaction is aborted, never committed, so the record is never visible."""


# The broker refusing a record for what it is, not for the moment: the record alone is at
# fault, and sending it again gives the same answer.
_RECORD_REFUSED = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE,
                   KafkaError.INVALID_RECORD}


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
    the refusal: one under way, or one made since that transaction's. A producer
    fenced by its epoch (Kafka 4 bumps it when it ends a transaction itself) is
    replaced, and its records are sent again: if that transaction was a commit whose
    answer was lost, which had happened, the log holds a copy, which every reader drops.

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
    stuck thread, if its call ever returns, touches nothing.
    """

    def __init__(
        self, bootstrap: str, transactional_id: str,
        settings: TransactionSettings = TransactionSettings(),
        offsets: Callable[[], dict[TP, int]] | None = None, *,
        on_committed: Callable[[dict[TP, int]], None] = lambda _o: None,
        on_fenced: Callable[[bool], None] = lambda _answered: None,
        offset_metadata: Callable[[TP], str] | None = None,
    ) -> None:
        timeout_ms, max_record_bytes = settings.timeout_ms, settings.max_record_bytes
        self._config = {
            **client_config(bootstrap),
            "compression.type": settings.compression,
            "transactional.id": transactional_id,
            "transaction.timeout.ms": timeout_ms,
            "linger.ms": 1,
            "message.max.bytes": max_record_bytes + RECORD_OVERHEAD,
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
        self._producer = Producer(self._config)
        # Per topic, the largest record it takes (its max.message.bytes, as read from the
        # cluster); the others, ``max_record_bytes``. A larger record is refused alone.
        self._max_record_bytes = max_record_bytes
        self._limits = dict(settings.limits)
        # A transactional id this process made for itself: if its producer is fenced, no
        # one else holds the id, so a new producer may take it up again.
        self._own_id = settings.own_id
        self._offsets = offsets
        # What each committed offset says besides itself (the group's offset metadata).
        self._offset_metadata = offset_metadata
        self._on_committed = on_committed
        self._on_fenced = on_fenced
        self._timeout_s = timeout_ms / 1000
        # Each blocking step of a transaction waits at most this long, so that a
        # transaction is aborted here, not timed out (and fenced) by the coordinator.
        self._step_s = self._timeout_s / 4
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._current: list[_Queued] = []  # the open transaction's records
        self._committing = False  # its commit was asked for: it may have happened
        self._doomed = False  # a record of it was answered NotAccepted: it must abort
        self._busy = False
        self._began: float | None = None  # when the open transaction began (monotonic)
        # A transaction begins at least this long after the previous one began, so that
        # more records share its fixed cost (its round trips and markers) on the broker.
        self._interval_s = settings.interval_ms / 1000
        self._last_began = 0.0
        self._gathers = settings.gathers  # see the class
        self._gathered = False
        self._first_queued = 0.0  # when the oldest queued record was queued (monotonic)
        self._generation = 0  # bumped when a stuck transaction thread is abandoned
        # Records queued past this bound make ``room()`` wait until a transaction takes them.
        self._max_queued = settings.max_queued
        self._roomy: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._commit_wanted = False
        self._epoch = 0
        self._group: Any = None  # the consumer's group metadata as of its last assignment
        self._stop = False
        self._quiet = QuietLog(log)
        self.failed: BaseException | None = None
        self.ready = threading.Event()  # the transactional id is registered
        self.transactions = 0
        self._thread = threading.Thread(target=self._run, name="kafka-transactions", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="kafka-deadlines",
                                          daemon=True)

    @property
    def epoch(self) -> int:
        return self._epoch

    def start(self) -> None:
        """Start the thread, which registers the transactional id (fencing an earlier
        process that used it; retried until the broker answers) and then commits."""
        self._thread.start()
        self._watchdog.start()

    def send(self, topic: str, event: Event, epoch: int = 0, deadline: float | None = None,
             headers: Sequence[tuple[str, bytes]] = ()) -> asyncio.Future[Position]:
        """Queue ``event``; the future resolves with its position once its transaction
        committed (see the class)."""
        return self.send_raw(topic, key_of(event), encode(event), headers, epoch, deadline)

    def send_nowait(self, topic: str, event: Event, epoch: int = 0,
                    key: bytes | None = None) -> None:
        """Queue ``event`` with no answer (its turn's terminal event is awaited instead);
        ``key``: its record key if the caller has it (``key_of(event)`` otherwise)."""
        self._enqueue([_Queued(epoch, topic, key or key_of(event), encode(event), [], None)])

    def send_raw(self, topic: str, key: bytes | None, value: bytes | None,
                 headers: Sequence[tuple[str, bytes]], epoch: int = 0,
                 deadline: float | None = None) -> asyncio.Future[Position]:
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        self._enqueue([_Queued(epoch, topic, key, value, list(headers), future, deadline)])
        return future

    def send_together(self, records: Sequence[Outgoing], epoch: int = 0
                      ) -> list[asyncio.Future[Position] | None]:
        """Queue ``records`` so that one transaction holds them all: none is visible
        without the others. Each that wants an answer (``Outgoing.answer``) gets a future,
        as ``send`` gives."""
        loop = asyncio.get_running_loop()
        items = [_Queued(epoch, r.topic, r.key, r.value, [],
                         loop.create_future() if r.answer else None, partition=r.partition)
                 for r in records]
        self._enqueue(items)
        return [item.future for item in items]

    def limit(self, topic: str) -> int:
        """The largest record (key, value and headers) ``topic`` takes from this producer."""
        return self.topic_limit(topic) - RECORD_OVERHEAD

    def topic_limit(self, topic: str) -> int:
        """``topic``'s own limit (its max.message.bytes), batch overhead included."""
        return self._limits.get(topic, self._max_record_bytes)

    def _enqueue(self, items: list[_Queued]) -> None:
        with self._cond:
            for item in items:
                if self.failed is not None:
                    _settle(item, ProduceError(f"the producer failed: {self.failed}"))
                elif item.epoch < self._epoch:
                    _settle(item, Fenced("written for turns this worker gave up"))
                elif item.size > self.limit(item.topic):
                    _refuse(item, RecordTooLarge(item.topic, item.size,
                                                 self.topic_limit(item.topic)))
            items = [item for item in items if not item.settled]
            if not items:
                return
            self._queue += items
            if len(self._queue) == len(items):  # the transaction thread waits for a first one
                self._first_queued = time.monotonic()
                self._cond.notify_all()

    def gathered(self) -> None:
        """What the sender has to write for now is queued (see ``gathers``)."""
        with self._cond:
            if self._queue and not self._gathered:
                self._gathered = True
                self._cond.notify_all()

    def _may_begin(self, now: float) -> float:
        """(Holding the lock.) 0 if a transaction may begin now, else how long to wait."""
        wait = self._last_began + self._interval_s - now
        if wait > 0:
            return wait
        if not self._gathers or self._gathered or not self._queue:
            return 0.0
        return max(self._first_queued + self._interval_s - now, 0.0)

    @property
    def backlogged(self) -> bool:
        """More records queued than ``max_queued`` (the log takes them slower than they
        come): a sender that can wait should (``room``)."""
        return len(self._queue) >= self._max_queued

    async def room(self) -> None:
        """Wait until the queue is under its bound: the next transaction took what waited,
        or it was dropped. A worker's turns wait here instead of queueing tokens without
        end while Kafka is slow; the engine merges what they have not read meanwhile."""
        while True:
            with self._cond:
                if not self.backlogged:
                    return
                if self._roomy is None:
                    self._roomy = (asyncio.get_running_loop(), asyncio.Event())
                event = self._roomy[1]
            await event.wait()

    def _emptied(self) -> None:
        """(Holding the lock, the queue just emptied.) Wake whoever waits for room."""
        if self._roomy is not None:
            loop, event = self._roomy
            self._roomy = None
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    def set_group(self, metadata: Any) -> None:
        """The consumer's group metadata, as read after its latest assignment: what each
        transaction shows the broker (a stale one is refused)."""
        self._group = metadata

    def commit_offsets(self) -> None:
        """Commit the offsets now even if nothing is queued (turns that ended since the
        last transaction, prompts that were skipped)."""
        with self._cond:
            self._commit_wanted = True
            self._cond.notify_all()

    def new_epoch(self) -> int:
        """Drop every record not yet in a transaction; later ones need the new epoch."""
        with self._cond:
            self._epoch += 1
            dropped, self._queue, self._gathered = self._queue, [], False
            self._emptied()
        for item in dropped:
            _settle(item, Fenced("written for turns this worker gave up"))
        return self._epoch

    def flush_sync(self, timeout: float) -> bool:
        """Block until everything queued so far has been committed or dropped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                if self.failed is not None or not self._cond.wait(deadline - time.monotonic()):
                    return False
        return True

    def _run(self, generation: int = 0) -> None:
        self._register()
        self.ready.set()
        backoff = Backoff(0.05, 2.0)
        while True:
            with self._cond:
                while not self._queue and not self._commit_wanted and not self._stop:
                    self._cond.wait()
            with self._cond:
                while not self._stop and (wait := self._may_begin(time.monotonic())):
                    self._cond.wait(wait)  # what is queued meanwhile joins this transaction
                if generation != self._generation:
                    return  # abandoned while registering: a newer thread runs
                if not self._queue and not self._commit_wanted:
                    if self._stop:
                        return
                    continue  # dropped meanwhile (``new_epoch``): wait for the next
                now = time.monotonic()
                stale = [q for q in self._queue if q.epoch != self._epoch]
                batch = [q for q in self._queue if q.epoch == self._epoch and not q.late(now)]
                late = [q for q in self._queue if q.late(now)]
                self._queue, self._busy, self._commit_wanted = [], True, False
                self._gathered = False
                self._emptied()
            for item in stale:
                _settle(item, Fenced("written for turns this worker gave up"))
            for item in late:
                _settle(item, NotAccepted("the log did not take it in time"))
            retry = self._transact(batch, generation)
            with self._cond:
                if generation != self._generation:
                    return  # abandoned: the watchdog queued the batch again
                if retry:  # before anything queued since, in the order it was sent
                    self._queue[:0] = [q for q in batch
                                       if q.epoch == self._epoch and not q.settled]
                self._busy = False
                self._cond.notify_all()
            if retry:
                time.sleep(backoff.next())
            else:
                backoff.reset()

    def _watch(self) -> None:
        """Answer ``NotAccepted`` for records past their deadline that are certain never
        to be written: queued ones (in no transaction), and those of an open transaction
        that has not asked to commit, which is then doomed to abort."""
        while True:
            stuck_since = self._began
            if (self._busy and not self._committing and stuck_since is not None
                    and time.monotonic() - stuck_since > self._timeout_s):
                # Made here, not holding the lock (a sender on an event loop waits for it).
                fresh = Producer(self._config)
                with self._cond:
                    if self._busy and not self._committing and self._began == stuck_since:
                        fresh = self._abandon_stuck(time.monotonic() - stuck_since, fresh)
                del fresh  # the one not used, destroyed outside the lock
            with self._cond:
                if self._stop and not self._busy and not self._queue:
                    return
                now = time.monotonic()
                late = [q for q in self._queue if q.late(now)]
                if not self._committing:
                    doomed = [q for q in self._current if q.late(now)]
                    late += doomed
                    self._doomed = self._doomed or bool(doomed)
                if late:
                    self._queue = [q for q in self._queue if not q.late(now)]
                    for item in late:
                        _settle(item, NotAccepted("the log did not take it in time"))
            time.sleep(0.05)

    def _abandon_stuck(self, waited_s: float, fresh: Producer) -> Producer:
        """(Holding the lock.) Leave the stuck transaction thread behind; ``fresh`` and a
        new thread send its transaction's records again (see the class). Returns the
        producer let go, for the caller to drop outside the lock."""
        log.error("a Kafka transaction has not reached its commit in %.0f s (a librdkafka "
                  "call that ignores its timeout: librdkafka #5456, #5511); replacing the "
                  "producer and sending its %d records again", waited_s, len(self._current))
        self._generation += 1
        self._queue[:0] = [q for q in self._current if q.epoch == self._epoch and not q.settled]
        self._current, self._busy, self._began = [], False, None
        # The new producer's registration fences the stuck one.
        old, self._producer = self._producer, fresh
        self._thread = threading.Thread(target=self._run, args=(self._generation,),
                                        name="kafka-transactions", daemon=True)
        self._thread.start()
        self._cond.notify_all()
        return old

    def _register(self) -> None:
        """init_transactions, retried until the broker answers."""
        backoff = Backoff(0.2, 5.0)
        while not self._stop:
            try:
                self._producer.init_transactions(self._timeout_s * 3)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.code() == KafkaError._STATE and "state Ready" in err.str():
                    return  # a call that timed out here went on and registered it
                if err.fatal():
                    self._producer = Producer(self._config)
                self._quiet.warning("could not register the transactional producer, "
                                    "retrying: %s", exc)
                time.sleep(backoff.next())

    def _transact(self, batch: list[_Queued], generation: int = 0) -> bool:
        """One transaction; True if its records must be sent again. A thread the watchdog
        abandoned (``generation`` old) does nothing more once its call returns."""
        p = self._producer
        if not batch and not (self._offsets and self._offsets()):
            return False
        offsets: dict[TP, int] = {}
        with self._cond:
            self._current, self._committing, self._doomed = batch, False, False
            self._began = self._last_began = time.monotonic()
        group = self._group  # the assignment this transaction shows the broker
        try:
            p.begin_transaction()
            for item in batch:
                self._produce(item)
            if p.flush(self._step_s):
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "records not delivered"))
            if self._offsets is not None:
                offsets = self._offsets()
                if not offsets or group is None:
                    raise KafkaException(KafkaError(KafkaError._STATE,
                                                    "no partition to fence with"))
                describe = self._offset_metadata
                p.send_offsets_to_transaction(
                    [TopicPartition(t, part, o, metadata=describe((t, part)))
                     if describe else TopicPartition(t, part, o)
                     for (t, part), o in offsets.items()], group, self._step_s)
            with self._cond:
                if generation != self._generation:
                    return False  # abandoned: never commit on a replaced producer
                if self._doomed:
                    raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                                    "a record's deadline passed"))
                self._committing = True
            self._commit()
        except KafkaException as exc:
            with self._cond:
                if generation != self._generation:
                    return False
                # The call returned: this thread is not stuck and handles the failure
                # itself, so the watchdog leaves it be. (A watchdog that replaced the
                # producer as the call returned left two threads renewing it, each
                # fencing the other's; seen once in CI, a worker's turns then stalled.)
                self._began = None
            return self._failed(exc.args[0], batch, group)
        finally:
            with self._cond:
                if generation == self._generation:
                    self._current, self._committing, self._began = [], False, None
        self.transactions += 1
        for item in batch:
            _settle(item, None)
        if offsets:
            self._on_committed(offsets)
        return False

    def _commit(self) -> None:
        """commit_transaction, asked again while the answer is lost (retriable errors):
        once sent, a commit may have happened, so it is never given up for an abort."""
        backoff = Backoff(0.05, 2.0)
        while True:
            try:
                self._producer.commit_transaction(self._step_s)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or err.txn_requires_abort() or err.fatal():
                    raise
                self._quiet.warning("a commit's answer was lost, asking again: %s", err)
                time.sleep(backoff.next())

    def _produce(self, item: _Queued) -> None:
        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                item.position = Position(msg.topic() or item.topic, msg.partition() or 0,
                                         msg.offset() or 0)
            elif err.code() in _RECORD_REFUSED:
                item.refused = err

        record: dict[str, Any] = {"value": item.value, "key": item.key,
                                  "on_delivery": delivered}
        if item.headers:
            record["headers"] = item.headers
        if item.partition is not None:
            record["partition"] = item.partition
        while True:
            try:
                self._producer.produce(item.topic, **record)
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                self._producer.poll(0.01)
            except KafkaException as exc:
                if exc.args[0].code() not in _RECORD_REFUSED:
                    raise
                # Refused by the client itself (its message.max.bytes): alone, at once.
                _refuse(item, RecordTooLarge(item.topic, item.size,
                                             self.topic_limit(item.topic)))
                return

    def _failed(self, err: KafkaError, batch: list[_Queued], group: Any) -> bool:
        """Handle a failed transaction (``group``: the metadata it showed the broker); True
        if its records must be sent again. Its records are never visible (aborted), so
        sending them again writes each exactly once."""
        code = err.code()
        refused = [item for item in batch if item.refused is not None]
        if refused:
            # The broker refuses a whole batch for its size: the largest of its records
            # is the one that cannot fit (a topic set lower than this producer was told),
            # refused alone; the others are sent again (if one of them cannot fit either,
            # the next refusal finds it).
            guilty = max(refused, key=lambda item: item.size)
            _refuse(guilty, RecordTooLarge(guilty.topic, guilty.size,
                                           self.topic_limit(guilty.topic)))
            for item in refused:
                item.refused = None
        if code in _PRODUCER_FENCING and not self._own_id:
            # A shared, stable transactional id: a newer process took it over.
            return self._give_up(err, batch)
        if err.fatal() or code in _PRODUCER_FENCING:
            # The coordinator refused this producer's epoch. With an id of our own, it did
            # so because it ended the transaction itself: aborted for outliving its
            # timeout, or, when a commit was asked and its answer lost (a coordinator
            # failing over), possibly committed. Its records are sent again: at worst a
            # committed copy precedes them, and every reader drops copies (a prompt's
            # request id, a delta's seq; seen in the outage suite).
            log.warning("transactional producer fenced (%s); starting a new one", err)
            self._renew()
            return True  # whether this worker still owns its partitions, the group decides
        try:
            self._producer.abort_transaction(self._step_s)
        except KafkaException as exc:
            log.warning("could not abort a transaction (%s); starting a new producer", exc)
            self._renew()  # a new producer under the id aborts the old one's transaction
        if code in _GROUP_FENCING or (code == KafkaError._STATE and "no partition" in err.str()):
            for item in batch:
                _settle(item, Fenced(str(err)))
            if any(item.epoch == self._epoch for item in batch):
                # News: this process still thought it owned its partitions.
                log.warning("transaction refused, this worker no longer owns its partitions: "
                            "%s", err)
                self.new_epoch()
                # Answered by an assignment: one under way (a rebalance, or no partitions
                # held), or one made since this transaction's.
                self._on_fenced(code in (KafkaError.REBALANCE_IN_PROGRESS, KafkaError._STATE)
                                or group is not self._group)
            return False  # (else: records of turns already given up at a revocation)
        self._quiet.warning("transaction aborted, sending its %d records again: %s",
                            len(batch), err)
        return True

    def _renew(self) -> None:
        """Replace a producer that failed for good with a new one under the same id (which
        fences the old one and aborts its open transaction)."""
        self._producer = Producer(self._config)
        self._register()

    def _give_up(self, err: KafkaError, batch: list[_Queued]) -> bool:
        log.error("the transactional producer failed for good: %s", err)
        self.failed = KafkaException(err)
        for item in batch:
            _settle(item, ProduceError(str(err)))
        return False

    def close(self, timeout: float = 30.0) -> None:
        self.flush_sync(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)


def _refuse(item: _Queued, error: RecordTooLarge) -> None:
    """Answer a record refused for itself; one nobody waits for is said in the log."""
    if item.future is None:
        log.error("a record for %s was dropped: %s", item.topic, error)
    _settle(item, error)


def _settle(item: _Queued, error: BaseException | None) -> None:
    """Answer the sender, once."""
    if item.settled:
        return
    item.settled = True
    future = item.future
    if future is None:
        return
    loop = future.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(resolve, future,
                              error if error is not None else item.position or Position("", 0, 0))
