"""The thread that makes a ``TransactionalProducer``'s transactions, back to back
(``TransactionLoop``): each takes what the outbox holds, produces it, sends the reading
group's offsets and commits, and handles a failure by what it says (see
``TransactionalProducer`` for the guarantees)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from pipeline.codec import TP, Position
from pipeline.kafka.client import Fenced, ProduceError, RecordTooLarge
from pipeline.kafka.clock import BrokerClock
from pipeline.kafka.outbox import Outbox, Queued, refuse, settle
from pipeline.retry import Backoff, QuietLog

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
# The broker refusing a record for what it is, not for the moment: the record alone is at
# fault, and sending it again gives the same answer.
_RECORD_REFUSED = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE,
                   KafkaError.INVALID_RECORD}

# Said with a record refused for its time: on a topic stamped by its writers
# (``pipeline.topics.WRITER_TIMED``), it is this host's clock.
_CLOCK_OFF = (" (this host's clock is further from the brokers' than the topic takes, an "
              "hour ahead by Kafka 4's default message.timestamp.after.max.ms: set it right, "
              "NTP; its records are sent again until then)")


class TransactionLoop:
    """Transactions of ``outbox``'s records on a producer made from ``config``; for a
    consumer's output, with its ``offsets`` (described by ``offset_metadata``): each
    committed set goes to ``on_committed``, and a refusal for ownership to ``on_fenced``
    (see ``TransactionalProducer``). ``own_id``: the transactional id is this process's
    own, so a fenced producer takes it up again."""

    def __init__(self, config: dict[str, Any], outbox: Outbox, timeout_s: float,
                 own_id: bool, offsets: Callable[[], dict[TP, int]] | None,
                 offset_metadata: Callable[[TP], str] | None,
                 on_committed: Callable[[dict[TP, int]], None],
                 on_fenced: Callable[[bool, Any], None]) -> None:
        self._config = config
        self._producer = Producer(config)
        self._outbox = outbox
        self._cond = outbox.cond
        self._timeout_s = timeout_s
        # Each blocking step of a transaction waits at most this long, so that a
        # transaction is aborted here, not timed out (and fenced) by the coordinator.
        self._step_s = timeout_s / 4
        self._own_id = own_id
        self._offsets = offsets
        self._offset_metadata = offset_metadata
        self._on_committed = on_committed
        self._on_fenced = on_fenced
        # The open transaction (guarded by the outbox's lock).
        self._current: list[Queued] = []  # its records
        self._committing = False  # its commit was asked for: it may have happened
        self._doomed = False  # a record of it was answered NotAccepted: it must abort
        self._began: float | None = None  # when it began (monotonic)
        # A call with a timeout of its own (registering, committing, aborting) not
        # returned yet: when it is late (monotonic), and what it is.
        self._waiting: tuple[float, str] | None = None
        self._generation = 0  # bumped when a stuck thread is abandoned
        self.group: Any = None  # the consumer's group metadata as of its last assignment
        self._stop = False
        self._quiet = QuietLog(log)
        self.ready = threading.Event()  # the transactional id is registered
        self.transactions = 0
        self.clock = BrokerClock()  # measured on this loop's deliveries
        self._thread = self._new_thread()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, args=(self._generation,),
                                name="kafka-transactions", daemon=True)

    def _run(self, generation: int) -> None:
        """Register the transactional id (fencing an earlier process that used it), then
        commit transactions until the outbox stops or the watchdog abandons this thread."""
        if not self._register(generation) and self._abandoned(generation):
            return  # the thread that replaced it registers its own producer
        self.ready.set()
        backoff = Backoff(0.05, 2.0)
        while (batch := self._outbox.next_batch(lambda: generation == self._generation)
               ) is not None:
            retry = self._transact(batch, generation)
            with self._cond:
                if generation != self._generation:
                    return  # abandoned: the watchdog queued the batch again
                self._outbox.give_back(batch if retry else [])
            if retry:
                time.sleep(backoff.next())
            else:
                backoff.reset()

    # The watchdog's side (``pipeline.kafka.watchdog``).

    def replace_if_stuck(self) -> None:
        """If a step before the commit has not returned within the transaction timeout,
        or a call with a timeout of its own (registering, committing, aborting) a
        transaction timeout past it, leave its thread behind: a new producer under the
        id fences the stuck one, and a new thread sends its records again (see
        ``TransactionalProducer``)."""
        if self._stuck(time.monotonic()) is None:
            return
        # Made here, not holding the lock (a sender on an event loop waits for it).
        fresh = Producer(self._config)
        with self._cond:
            what = self._stuck(time.monotonic())  # still: its call may have returned
            if what is not None:
                fresh = self._abandon_stuck(what, fresh)
        del fresh  # the one not used, destroyed outside the lock

    def _stuck(self, now: float) -> str | None:
        """What has not returned in time on the transactions' thread, if anything."""
        began, waiting = self._began, self._waiting
        if (began is not None and now - began > self._timeout_s and self._outbox.busy
                and not self._committing):
            return f"a Kafka transaction has not reached its commit in {now - began:.0f} s"
        if waiting is not None and now > waiting[0]:
            return (f"the transactional producer's {waiting[1]} has not returned "
                    f"{now - waiting[0] + self._timeout_s:.0f} s past its timeout")
        return None

    def doom_late(self, now: float) -> list[Queued]:
        """(Holding the lock.) The open transaction's records past their deadline, if it
        has not asked to commit: it is then doomed to abort."""
        if self._committing:
            return []
        doomed = [q for q in self._current if q.late(now)]
        self._doomed = self._doomed or bool(doomed)
        return doomed

    def _abandon_stuck(self, what: str, fresh: Producer) -> Producer:
        """(Holding the lock.) Leave the stuck thread behind; ``fresh`` and a new thread
        take over. Returns the producer let go, for the caller to drop outside the lock."""
        log.error("%s (a librdkafka call that ignores its timeout: librdkafka #5456, "
                  "#5511); replacing the producer and sending its %d records again", what,
                  len(self._current))
        self._generation += 1
        current, self._current, self._began = self._current, [], None
        self._waiting, self._committing = None, False
        self._outbox.give_back(current)
        # The new producer's registration fences the stuck one.
        old, self._producer = self._producer, fresh
        self._thread = self._new_thread()
        self._thread.start()
        return old

    # One transaction.

    def _register(self, generation: int) -> bool:
        """init_transactions, retried until the broker answers; False if the loop stopped
        or the watchdog abandoned this thread (``_abandoned``) first."""
        backoff = Backoff(0.2, 5.0)
        while not self._stop:
            p = self._watch(generation, self._timeout_s * 3, "registration")
            if p is None:
                return False
            try:
                p.init_transactions(self._timeout_s * 3)
            except KafkaException as exc:
                if not self._unwatch(generation):
                    return False
                err = exc.args[0]
                if err.code() == KafkaError._STATE and "state Ready" in err.str():
                    return True  # a call that timed out here went on and registered it
                if err.fatal():
                    self._renew_producer(generation)
                self._quiet.warning("could not register the transactional producer, "
                                    "retrying: %s", exc)
                time.sleep(backoff.next())
                continue
            return self._unwatch(generation)
        return False

    def _watch(self, generation: int, timeout_s: float, what: str) -> Producer | None:
        """The producer, for a call (``what``) that should return within ``timeout_s``:
        past it and the transaction timeout more, the watchdog replaces it. None if this
        thread was abandoned."""
        with self._cond:
            if generation != self._generation:
                return None
            self._waiting = (time.monotonic() + timeout_s + self._timeout_s, what)
            return self._producer

    def _unwatch(self, generation: int) -> bool:
        """The watched call returned: False if this thread was abandoned meanwhile (it
        then does nothing more: its records were given to the thread that replaced it)."""
        with self._cond:
            if generation != self._generation:
                return False
            self._waiting = None
            return True

    def _abandoned(self, generation: int) -> bool:
        with self._cond:
            return generation != self._generation

    def _renew_producer(self, generation: int) -> None:
        fresh = Producer(self._config)  # made outside the lock, like the watchdog's
        with self._cond:
            if generation == self._generation:
                fresh, self._producer = self._producer, fresh
        del fresh  # the one let go

    def _transact(self, batch: list[Queued], generation: int) -> bool:
        """One transaction; True if its records must be sent again. A thread the watchdog
        abandoned (``generation`` old) does nothing more once its call returns."""
        p = self._producer
        if not batch and not (self._offsets and self._offsets()):
            return False
        offsets: dict[TP, int] = {}
        with self._cond:
            self._current, self._committing, self._doomed = batch, False, False
            self._began = now = time.monotonic()
            self._outbox.began(now)
        group = self.group  # the assignment this transaction shows the broker
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
            if not self._commit(generation):
                return False  # abandoned: its records go again on the new producer
        except KafkaException as exc:
            with self._cond:
                if generation != self._generation:
                    return False
                # The call returned: this thread is not stuck and handles the failure
                # itself, so the watchdog leaves it be. (A watchdog that replaced the
                # producer as the call returned left two threads renewing it, each
                # fencing the other's; seen once in CI, a worker's turns then stalled.)
                self._began = None
            return self._failed(exc.args[0], batch, group, generation)
        finally:
            with self._cond:
                if generation == self._generation:
                    self._current, self._committing, self._began = [], False, None
        self.transactions += 1
        for item in batch:
            settle(item, None)
        if offsets:
            self._on_committed(offsets)
        return False

    def _commit(self, generation: int) -> bool:
        """commit_transaction, asked again while the answer is lost (retriable errors):
        once sent, a commit may have happened, so it is never given up for an abort.
        False if the watchdog abandoned this thread meanwhile (a call that ignored its
        timeout): the records go again on the new producer, and if this commit happened
        after all, every reader drops the copies (as after a lost commit's fencing)."""
        backoff = Backoff(0.05, 2.0)
        while True:
            p = self._watch(generation, self._step_s, "commit")
            if p is None:
                return False
            try:
                p.commit_transaction(self._step_s)
            except KafkaException as exc:
                if not self._unwatch(generation):
                    return False
                err = exc.args[0]
                if not err.retriable() or err.txn_requires_abort() or err.fatal():
                    raise
                self._quiet.warning("a commit's answer was lost, asking again: %s", err)
                time.sleep(backoff.next())
                continue
            return self._unwatch(generation)

    def _produce(self, item: Queued) -> None:
        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                item.position = Position(msg.topic() or item.topic, msg.partition() or 0,
                                         msg.offset() or 0)
                self.clock.observe(msg)
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
                self._refuse(item)
                return

    def _refuse(self, item: Queued) -> None:
        limits = self._outbox.limits
        refuse(item, RecordTooLarge(item.topic, item.size, limits.of(item.topic)))

    def _failed(self, err: KafkaError, batch: list[Queued], group: Any,
                generation: int) -> bool:
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
            self._refuse(max(refused, key=lambda item: item.size))
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
            self._renew(generation)
            return True  # whether this worker still owns its partitions, the group decides
        p = self._watch(generation, self._step_s, "abort")
        if p is None:
            return False
        try:
            p.abort_transaction(self._step_s)
        except KafkaException as exc:
            if not self._unwatch(generation):
                return False
            log.warning("could not abort a transaction (%s); starting a new producer", exc)
            self._renew(generation)  # a new producer aborts the old one's transaction
            if self._abandoned(generation):
                return False
        else:
            if not self._unwatch(generation):
                return False  # abandoned: the thread that replaced it sends its records
        if code in _GROUP_FENCING or (code == KafkaError._STATE and "no partition" in err.str()):
            for item in batch:
                settle(item, Fenced(str(err)))
            if any(item.epoch == self._outbox.epoch for item in batch):
                # News: this process still thought it owned its partitions.
                log.warning("transaction refused, this worker no longer owns its partitions: "
                            "%s", err)
                self._outbox.new_epoch()
                # Answered by an assignment: one under way (a rebalance, or no partitions
                # held), or one made since this transaction's (``group``: the one it
                # showed).
                self._on_fenced(code in (KafkaError.REBALANCE_IN_PROGRESS, KafkaError._STATE)
                                or group is not self.group, group)
            return False  # (else: records of turns already given up at a revocation)
        self._quiet.warning("transaction aborted, sending its %d records again: %s%s",
                            len(batch), err, _CLOCK_OFF if code == KafkaError.INVALID_TIMESTAMP
                            else "")
        return True

    def _renew(self, generation: int) -> bool:
        """Replace a producer that failed for good with a new one under the same id (which
        fences the old one and aborts its open transaction); False as ``_register``."""
        self._renew_producer(generation)
        return self._register(generation)

    def _give_up(self, err: KafkaError, batch: list[Queued]) -> bool:
        log.error("the transactional producer failed for good: %s", err)
        self._outbox.failed = KafkaException(err)
        for item in batch:
            settle(item, ProduceError(str(err)))
        return False
