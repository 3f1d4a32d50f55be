"""The Kafka adapter: the only module that imports confluent_kafka.

* ``EventProducer``: idempotent, ``acks=all`` producer with its own poll thread;
  ``send`` returns an asyncio future that resolves once Kafka acknowledged the record.
* ``AsyncConsumer``: a consumer whose blocking calls run, one at a time, on a
  dedicated thread, so an asyncio service can await them.
* ``ensure_topics`` / ``wait_for_broker``: administration.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

# NewTopic's documented home is confluent_kafka.admin, which re-exports it from the private
# cimpl module without marking the re-export (strict mypy wants that marked).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)

from pipeline.codec import TP, Position, encode, key_of
from pipeline.kafka_config import AccessRefused, client_properties, describe_listener
from pipeline.retry import QuietLog, RepeatFilter
from pipeline.topics import DEADLETTER_HEADROOM, TopicSpec
from schemas import Event

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = [
    "AccessRefused",
    "AsyncConsumer",
    "EventProducer",
    "Fenced",
    "GroupStatus",
    "KafkaException",
    "Outgoing",
    "ProduceError",
    "Record",
    "RecordTooLarge",
    "TransactionalProducer",
    "check_access",
    "client_config",
]


@dataclass(frozen=True)
class Record:
    position: Position
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: list[tuple[str, str | bytes | None]] | None = None  # a prompt's trace context


@dataclass(frozen=True)
class Outgoing:
    """A record to write (``TransactionalProducer.send_together``): to ``partition`` if
    given (else the key's), with an answer when its transaction ends if ``answer``."""

    topic: str
    key: bytes | None
    value: bytes
    partition: int | None = None
    answer: bool = False


class ProduceError(RuntimeError):
    """Kafka did not acknowledge a record."""


class Fenced(ProduceError):
    """The broker refused a transaction: this process no longer owns what it wrote for."""


def client_config(bootstrap: str) -> dict[str, Any]:
    """What every Kafka client starts from: the cluster's address and the operator's
    client properties (``PIPELINE_KAFKA_CONFIG``: TLS, SASL)."""
    return {**client_properties(), "bootstrap.servers": bootstrap}


# librdkafka leaves Nagle's algorithm on. A turn's first events then waited for the
# previous request's TCP acknowledgement: measured here, up to 265 ms between a worker
# producing a turn's first token and the gateway reading it (3-6 ms without Nagle).
NO_NAGLE = {"socket.nagle.disable": True}


def _producer_config(bootstrap: str, linger_ms: float, timeout_ms: int,
                     compression: str) -> dict[str, Any]:
    return {
        **client_config(bootstrap),
        "compression.type": compression,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": linger_ms,
        # The Java client's partitioner, so every client agrees where a key lives.
        "partitioner": "murmur2_random",
        # How long a record may take to be acknowledged before its send fails.
        "message.timeout.ms": timeout_ms,
        **NO_NAGLE,
    }


_client_errors = QuietLog(log, every_s=30.0)
_consumer_errors = QuietLog(log, every_s=30.0)


def _log_client_error(err: KafkaError) -> None:
    if err.fatal():
        log.error("a Kafka client failed for good: %s", err)
    else:
        _client_errors.warning("Kafka client error (retried): %s", err)


def client_logging(name: str) -> dict[str, Any]:
    """librdkafka's own log lines through Python logging, each shape of message at most
    once per 30 s (a broker away logged a line per connection attempt: 10,644 in 2.5
    minutes), and its client errors likewise."""
    logger = logging.getLogger(f"librdkafka.{name}")
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        logger.addFilter(RepeatFilter(every_s=30.0))
    return {"logger": logger, "error_cb": _log_client_error, "log.connection.close": False}


class EventProducer:
    """Produces events, idempotently with ``acks=all``; ``send`` resolves once the record
    is durable in Kafka, or fails within ``timeout_ms`` (the record may still land: this
    producer is for facts that may arrive late, not for turns, which the gateway writes
    in transactions). A producer that failed for good is replaced."""

    def __init__(self, bootstrap: str, *, linger_ms: float = 1.0,
                 timeout_ms: int = 30_000, max_record_bytes: int = 8 * 2**20,
                 compression: str = "zstd") -> None:
        # Dead letters are records read elsewhere plus headers: room for both.
        self._max_record_bytes = max_record_bytes + DEADLETTER_HEADROOM
        self._config = {**_producer_config(bootstrap, linger_ms, timeout_ms, compression),
                        **client_logging("producer"), "error_cb": self._on_error,
                        "message.max.bytes": self._max_record_bytes + RECORD_OVERHEAD}
        self._failed = False
        self._producer = Producer(self._config)
        self._stop = threading.Event()
        # Records the local queue had no room for, in order; the poll thread produces them
        # as deliveries make room, so no caller (an event loop) ever waits for it.
        self._overflow: collections.deque[dict[str, Any]] = collections.deque()
        self._overflow_lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="kafka-producer-poll", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self._failed:
                self._replace()
            self._producer.poll(0.01 if self._overflow else 0.05)
            if self._overflow:
                self._drain_overflow()

    def _replace(self) -> None:
        """(On the poll thread, so no caller waits for it.) A new producer for one that
        failed for good; the old one fails what it still held and is destroyed here,
        outside the lock (its destruction may wait on its connections)."""
        log.warning("replacing a Kafka producer that failed for good")
        fresh = Producer(self._config)
        with self._overflow_lock:
            old, self._producer, self._failed = self._producer, fresh, False
        with contextlib.suppress(KafkaException):
            old.purge(in_queue=True, in_flight=True, blocking=False)
            old.poll(0)
        del old

    def _drain_overflow(self) -> None:
        with self._overflow_lock:
            while self._overflow and not self._failed:
                try:
                    self._producer.produce(**self._overflow[0])
                except BufferError:
                    return
                self._overflow.popleft()

    def send(self, topic: str, event: Event) -> asyncio.Future[Position]:
        return self.send_raw(topic, key_of(event), encode(event))

    def _on_error(self, err: KafkaError) -> None:
        _log_client_error(err)
        if err.fatal():
            self._failed = True

    @property
    def max_record_bytes(self) -> int:
        """The largest record (key, value, headers) this producer sends."""
        return self._max_record_bytes

    def _produce(self, topic: str, **record: Any) -> None:
        """Hand the record to librdkafka; if its queue is full, to the overflow (never
        dropped, never waited for here)."""
        with self._overflow_lock:
            # A producer that failed for good (the idempotent producer's epoch lost, say)
            # takes nothing more: the record waits for its replacement (``_replace``).
            if not self._overflow and not self._failed:
                try:
                    self._producer.produce(topic, **record)
                    return
                except BufferError:
                    pass
            self._overflow.append({"topic": topic, **record})

    def send_raw(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> asyncio.Future[Position]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Position] = loop.create_future()
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v) for k, v in headers)
        if size > self._max_record_bytes:  # refused alone, at once: never queued
            future.set_exception(RecordTooLarge(topic, size, self._max_record_bytes))
            return future

        def settle(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                result: Position | BaseException = ProduceError(str(err))
            else:
                result = Position(msg.topic() or topic, msg.partition() or 0, msg.offset() or 0)
            loop.call_soon_threadsafe(_resolve, future, result)

        self._produce(topic, value=value, key=key, headers=list(headers), on_delivery=settle)
        return future

    def flush(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self._overflow and time.monotonic() < deadline:
            time.sleep(0.01)
        return int(self._producer.flush(max(deadline - time.monotonic(), 0))) + len(
            self._overflow)

    def close(self) -> None:
        remaining = self.flush()
        if remaining:
            log.error("%d records were not delivered before close", remaining)
        self._stop.set()
        self._thread.join()


def _poll(consumer: Consumer, max_records: int, timeout: float) -> list[Record]:
    """Up to ``max_records``: wait at most ``timeout`` for the first, then take only what
    is already buffered. (``consume(n, timeout)`` alone waits until it has all ``n``
    or the timeout passes, which adds the whole timeout to every hop when traffic is light.)
    """
    first = consumer.poll(timeout)
    if first is None:
        return []
    messages = [first]
    if max_records > 1:
        messages += consumer.consume(max_records - 1, 0)
    records = []
    for msg in messages:
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                continue
            if err.fatal():
                raise KafkaException(err)
            # Anything else librdkafka recovers from by itself (a broker restarting, a
            # leader moving): said, at most once per 30 s for each kind.
            _consumer_errors.warning("consumer error (it recovers by itself): %s", err)
            continue
        _, ts = msg.timestamp()
        records.append(Record(
            Position(msg.topic() or "", msg.partition() or 0, msg.offset() or 0),
            msg.key(), msg.value(), ts, _headers(msg),
        ))
    return records


def _headers(msg: Message) -> list[tuple[str, str | bytes | None]] | None:
    headers = msg.headers()
    return list(headers.items()) if isinstance(headers, dict) else headers


def _resolve(future: asyncio.Future[Position], result: Position | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)



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


class RecordTooLarge(ProduceError):
    """A record larger than its topic takes: refused alone, at once, and never retried
    (it never enters a transaction, so it holds back no other record). ``limit``: the
    topic's max.message.bytes (a record's own bytes must leave room for its batch's)."""

    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(f"a record of {size:,} bytes is larger than {topic} takes "
                         f"({limit:,} bytes, less {RECORD_OVERHEAD} for its batch)")
        self.topic, self.size, self.limit = topic, size, limit


# What a Kafka record costs beyond its key, value and headers (its batch's header, the
# record's own fields): kept free under a topic's max.message.bytes.
RECORD_OVERHEAD = 512
# The broker refusing a record for what it is, not for the moment: the record alone is at
# fault, and sending it again gives the same answer.
_RECORD_REFUSED = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE,
                   KafkaError.INVALID_RECORD}


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
        offsets: Callable[[], dict[TP, int]] | None = None, *,
        on_committed: Callable[[dict[TP, int]], None] = lambda _o: None,
        on_fenced: Callable[[bool], None] = lambda _answered: None, timeout_ms: int = 10_000,
        own_id: bool = True, interval_ms: float = 0.0, max_queued: int = 20_000,
        gathers: bool = False, max_record_bytes: int = 8 * 2**20,
        limits: dict[str, int] | None = None,
        offset_metadata: Callable[[TP], str] | None = None, compression: str = "zstd",
    ) -> None:
        self._config = {
            **client_config(bootstrap),
            "compression.type": compression,
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
        self._limits = dict(limits or {})
        # A transactional id this process made for itself: if its producer is fenced, no
        # one else holds the id, so a new producer may take it up again.
        self._own_id = own_id
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
        self._interval_s = interval_ms / 1000
        self._last_began = 0.0
        self._gathers = gathers  # see the class
        self._gathered = False
        self._first_queued = 0.0  # when the oldest queued record was queued (monotonic)
        self._generation = 0  # bumped when a stuck transaction thread is abandoned
        # Records queued past this bound make ``room()`` wait until a transaction takes them.
        self._max_queued = max_queued
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
        backoff = 0.0
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
                backoff = min(max(backoff * 2, 0.05), 2.0)
                time.sleep(backoff)
            else:
                backoff = 0.0

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
        delay = 0.2
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
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

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
        delay = 0.05
        while True:
            try:
                self._producer.commit_transaction(self._step_s)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or err.txn_requires_abort() or err.fatal():
                    raise
                self._quiet.warning("a commit's answer was lost, asking again: %s", err)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

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
    loop.call_soon_threadsafe(_resolve, future,
                              error if error is not None else item.position or Position("", 0, 0))


# librdkafka adds a newly assigned partition to its fetches only once the long poll in
# flight returns (``fetch.wait.max.ms``, 500 ms by default). Consumers whose assignment
# changes, or whose paused partitions resume, while a client waits keep that poll short.
QUICK_ASSIGN = {"fetch.wait.max.ms": 10}
# Given the partitions just assigned, the offsets to start them at (None: the committed ones).
OnAssign = Callable[[list[TP]], dict[TP, int] | None]
OnRevoke = Callable[[list[TP]], None]
BEGINNING = OFFSET_BEGINNING
# As a ListOffsets timestamp (``offsets_for_times``): a partition's end.
LATEST = -1


class AsyncConsumer:
    """A confluent-kafka consumer driven from asyncio.

    Every call to the underlying consumer runs on one dedicated thread, so calls
    never overlap and rebalance callbacks run on that thread too.
    """

    def __init__(self, bootstrap: str, group_id: str, **extra: Any) -> None:
        config: dict[str, Any] = {
            **client_config(bootstrap),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            **NO_NAGLE,
            **client_logging("consumer"),
        }
        config.update(extra)
        self._consumer = Consumer(config)
        # What ``subscribe`` was given, for ``rejoin_sync``.
        self._subscription: tuple[list[str], Callable[..., None], Callable[..., None]] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kafka-consumer-{group_id}"
        )

    def group_metadata_sync(self) -> Any:
        """The group's generation and this member's id, for transactions. Read it on the
        consumer's thread (in a rebalance callback): from another thread the call waits
        for the consumer's poll to return (measured: a fifth of a busy worker's time)."""
        return self._consumer.consumer_group_metadata()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def subscribe(
        self, topics: list[str], on_assign: OnAssign | None = None,
        on_revoke: OnRevoke | None = None,
    ) -> None:
        """Join the group; the callbacks run on the consumer thread during a poll."""

        def assigned(consumer: Consumer, parts: list[TopicPartition]) -> None:
            offsets = on_assign([(p.topic, p.partition) for p in parts]) if on_assign else None
            if offsets is not None:
                consumer.assign([TopicPartition(p.topic, p.partition,
                                                offsets.get((p.topic, p.partition), BEGINNING))
                                 for p in parts])

        def revoked(consumer: Consumer, parts: list[TopicPartition]) -> None:
            if on_revoke is not None:
                on_revoke([(p.topic, p.partition) for p in parts])

        self._subscription = (topics, assigned, revoked)
        self._consumer.subscribe(topics, on_assign=assigned, on_revoke=revoked)

    def rejoin_sync(self) -> None:
        """Leave the group and join it again, with the same topics and callbacks: the
        assignment is revoked and made anew (callbacks run in the polls that follow),
        whether or not the group had moved on without this member."""
        assert self._subscription is not None, "rejoin_sync before subscribe"
        topics, assigned, revoked = self._subscription
        self._consumer.unsubscribe()
        self._consumer.subscribe(topics, on_assign=assigned, on_revoke=revoked)

    # The methods below run on the consumer thread (from callbacks, or via ``call``).

    def poll_batch_sync(self, max_records: int, timeout: float) -> list[Record]:
        return _poll(self._consumer, max_records, timeout)

    async def poll_batch(self, max_records: int, wait_s: float) -> list[Record]:
        return await self.call(self.poll_batch_sync, max_records, wait_s)

    def poll_window_sync(self, max_records: int, wait_s: float, window_s: float) -> list[Record]:
        """Up to ``max_records``: wait at most ``wait_s`` for the first, then gather what
        arrives for ``window_s`` after it, so a busy reader takes fewer, larger batches."""
        records = _poll(self._consumer, max_records, wait_s)
        if not records:
            return records
        deadline = time.monotonic() + window_s
        while len(records) < max_records:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            records += _poll(self._consumer, max_records - len(records), left)
        return records

    async def poll_window(self, max_records: int, wait_s: float,
                          window_s: float) -> list[Record]:
        return await self.call(self.poll_window_sync, max_records, wait_s, window_s)

    def commit_sync(self, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``next offset to read`` per (topic, partition); blocks until done."""
        if offsets:
            parts = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
            self._consumer.commit(offsets=parts, asynchronous=False)

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        if offsets:
            await self.call(self.commit_sync, offsets)

    def _assigned(self, topic: str | None) -> list[TopicPartition]:
        return [tp for tp in self._consumer.assignment() if topic is None or tp.topic == topic]

    def restart_fetch_sync(self, partitions: list[TP]) -> None:
        """Seek ``partitions`` to their current positions, which restarts their fetch.
        (Seen in the outage suite: after a broker was paused and leadership moved, a
        newly assigned partition delivered nothing for minutes while records waited.)"""
        for tp in self._consumer.position([TopicPartition(t, p) for t, p in partitions]):
            if tp.offset >= 0:
                self._consumer.seek(tp)

    def pause_sync(self, topic: str | None = None) -> None:
        """Stop fetching the assigned partitions (of ``topic`` only, if given)."""
        self._consumer.pause(self._assigned(topic))

    def resume_sync(self, topic: str | None = None) -> None:
        """Resume the assigned partitions (of ``topic`` only, if given), and have their
        fetches start now. librdkafka's fetcher notices a resumed partition when the
        broker thread serving it next wakes: up to a second later when it fetches nothing
        else (measured: a full worker's next prompts waited 600 ms at every turn from
        full to free). A ListOffsets request for each partition wakes the thread that
        serves it."""
        partitions = self._assigned(topic)
        self._consumer.resume(partitions)
        self._wake_fetcher(partitions)

    def committed_sync(self, partitions: list[TP], timeout: float = 30.0,
                       fallback: Callable[[list[TP]], dict[TP, int]] | None = None,
                       ) -> dict[TP, int]:
        """The group's committed offset of each partition; for those it never committed,
        what ``fallback`` gives for them, else the partition's start."""
        out = {(tp.topic, tp.partition): int(tp.offset) for tp in self._consumer.committed(
            [TopicPartition(t, p) for t, p in partitions], timeout=timeout)}
        missing = [tp for tp, offset in out.items() if offset < 0]
        if missing and fallback is not None:
            out.update(fallback(missing))
        for (topic, partition), offset in out.items():
            if offset < 0:
                out[(topic, partition)] = self.watermarks_sync(topic, partition)[0]
        return out

    def _wake_fetcher(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KafkaException):  # only a wake-up: best effort
                self._consumer.get_watermark_offsets(tp, timeout=5, cached=False)

    def assignment_sync(self) -> list[TP]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def positions_sync(self, partitions: list[TP] | None = None) -> dict[TP, int]:
        """The next offset to read of each partition (of the assignment if not given):
        past transaction markers and aborted records too, which are never delivered."""
        tps = ([TopicPartition(t, p) for t, p in partitions] if partitions is not None
               else self._consumer.assignment())
        return {(tp.topic, tp.partition): int(tp.offset)
                for tp in self._consumer.position(tps) if tp.offset >= 0}

    def lag_sync(self) -> dict[TP, int]:
        """Records behind the end of each assigned partition (from cached watermarks)."""
        lag = {}
        for tp in self._consumer.position(self._consumer.assignment()):
            _, high = self._consumer.get_watermark_offsets(tp, cached=True)
            if tp.offset >= 0 and high >= 0:
                lag[(tp.topic, tp.partition)] = max(int(high) - int(tp.offset), 0)
        return lag

    def assign_partitions_sync(self, partitions: list[TP]) -> dict[TP, int]:
        """Read ``partitions`` from their start up to the end they have now; return the
        ends of those that hold anything."""
        ends: dict[TP, int] = {}
        starts = []
        for topic, p in partitions:
            low, high = self.watermarks_sync(topic, p)
            if high > low:
                ends[(topic, p)] = high
                starts.append(TopicPartition(topic, p, low))
        self._consumer.assign(starts)
        return ends

    def assign_from_start_sync(self, topics: list[str]) -> dict[TP, int]:
        """Every partition of ``topics``, as ``assign_partitions_sync``."""
        return self.assign_partitions_sync(
            [(t, p) for t in topics for p in self.partitions_sync(t)])

    def watermarks_sync(self, topic: str, partition: int, timeout: float = 5.0) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout, cached=False
        )
        return int(low), int(high)

    def partitions_sync(self, topic: str, timeout: float = 10.0) -> list[int]:
        meta = self._consumer.list_topics(topic, timeout=timeout)
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise KafkaException(info.error if info else f"no topic {topic}")
        return sorted(info.partitions)

    def add_partitions_sync(self, starts: dict[TP, int]) -> None:
        """Also read these partitions, each from the given offset (the rest keep their
        place), fetching them at once (see ``resume_sync``)."""
        partitions = [TopicPartition(t, p, o) for (t, p), o in starts.items()]
        self._consumer.incremental_assign(partitions)
        self._wake_fetcher(partitions)

    def follow_from_end_sync(self, topic: str) -> None:
        """Read every partition of ``topic`` from the end it has now on."""
        self.add_partitions_sync({(topic, p): self.watermarks_sync(topic, p)[1]
                                  for p in self.partitions_sync(topic)})

    def drop_partitions_sync(self, partitions: list[TP]) -> None:
        self._consumer.incremental_unassign([TopicPartition(t, p) for t, p in partitions])

    def read_range_sync(
        self, topic: str, partition: int, start: int, end: int, timeout: float = 30.0
    ) -> list[Record]:
        """The records of one partition from ``start`` up to (not including) ``end``."""
        if start >= end:
            return []
        tp = TopicPartition(topic, partition, start)
        self._consumer.assign([tp])
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                batch = _poll(self._consumer, 5000, 0.2)
                records += [r for r in batch if r.position.offset < end]
                if batch and batch[-1].position.offset + 1 >= end:
                    return records
                if not batch and self._consumer.position([tp])[0].offset >= end:
                    return records  # the range ends in offsets that hold no record
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reading {topic}/{partition} [{start}, {end}) timed out")
        finally:
            self._consumer.unassign()

    def read_at_sync(self, wanted: Sequence[tuple[str, int, int]],
                     timeout: float = 30.0) -> dict[tuple[str, int, int], Record | None]:
        """The records at these exact positions (topic, partition, offset), read at once;
        None for a position that holds no committed record (an aborted one, a marker, or
        one the topic no longer keeps)."""
        todo = {(t, p): o for t, p, o in wanted}
        if len(todo) != len(set(wanted)):
            raise ValueError("read_at_sync reads one offset per partition")
        found: dict[tuple[str, int, int], Record | None] = dict.fromkeys(wanted)
        if not todo:
            return found
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in todo.items()])
        deadline = time.monotonic() + timeout
        try:
            while todo:
                for record in _poll(self._consumer, 100, 0.2):
                    pos = record.position
                    want = todo.get((pos.topic, pos.partition))
                    if want is None or pos.offset < want:
                        continue
                    if pos.offset == want:
                        found[(pos.topic, pos.partition, want)] = record
                    del todo[(pos.topic, pos.partition)]
                for tp in self._consumer.position(
                        [TopicPartition(t, p) for t, p in list(todo)]):
                    if (tp.topic, tp.partition) in todo and tp.offset > todo[(tp.topic,
                                                                              tp.partition)]:
                        del todo[(tp.topic, tp.partition)]  # passed over: nothing there
                for (t, p), o in list(todo.items()):
                    low, high = self._consumer.get_watermark_offsets(TopicPartition(t, p),
                                                                      cached=True)
                    if 0 <= high <= o or 0 <= o < low:  # not written yet, or gone
                        del todo[(t, p)]
                if todo and time.monotonic() > deadline:
                    raise TimeoutError(f"reading {sorted(todo)} timed out")
        finally:
            self._consumer.unassign()
        return found

    def offset_for_time_sync(self, topic: str, partition: int, ms: int,
                             timeout: float = 10.0) -> int:
        """The first offset at or after time ``ms`` (the end of the partition if none)."""
        found = self._consumer.offsets_for_times([TopicPartition(topic, partition, ms)],
                                                 timeout=timeout)[0]
        if found.offset >= 0:
            return int(found.offset)
        return self.watermarks_sync(topic, partition)[1]

    async def close(self) -> None:
        try:
            await self.call(self._consumer.close)
        finally:
            self._executor.shutdown(wait=True)


def group_committed(bootstrap: str, group: str, partitions: list[TP],
                    timeout: float = 10.0) -> dict[TP, int]:
    """Another group's committed offsets (without joining it); partitions it never
    committed are left out."""
    consumer = Consumer({**client_config(bootstrap), "group.id": group,
                         "enable.auto.commit": False, **client_logging("group-status")})
    try:
        found = consumer.committed([TopicPartition(t, p) for t, p in partitions],
                                   timeout=timeout)
        return {(tp.topic, tp.partition): int(tp.offset) for tp in found if tp.offset >= 0}
    finally:
        consumer.close()


class GroupStatus:
    """A consumer group seen from outside, without joining it: how far it is behind the
    end of a topic (its committed offsets)."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self._consumer = Consumer({**client_config(bootstrap), "group.id": group,
                                   **client_logging("group-status"),
                                   "enable.auto.commit": False})
        self._known: dict[str, tuple[float, list[int]]] = {}

    def per_partition(self, topic: str, timeout: float = 5.0,
                      uncommitted_at_end: bool = False) -> dict[int, tuple[int, int]]:
        """Per partition: (committed offset, end offset); a partition the group never
        committed counts from its start (or, ``uncommitted_at_end``, as caught up).
        Two requests whatever the number of partitions: the committed offsets, and the
        ends in one ListOffsets (a gateway measures this four times a second)."""
        return {p: (start, end) for p, (start, end, _) in self.committed_and_ends(
            topic, timeout, uncommitted_at_end).items()}

    def committed_and_ends(self, topic: str, timeout: float = 5.0,
                           uncommitted_at_end: bool = False
                           ) -> dict[int, tuple[int, int, str]]:
        """``per_partition``, with what each commit said besides its offset (its
        metadata; empty if none)."""
        parts = [TopicPartition(topic, p) for p in self._partitions(topic, timeout)]
        committed = self._consumer.committed(parts, timeout=timeout)
        ends = {tp.partition: int(tp.offset) for tp in self._consumer.offsets_for_times(
            [TopicPartition(topic, p.partition, LATEST) for p in parts], timeout=timeout)}
        out = {}
        for tp in committed:
            high = ends[tp.partition]
            if tp.offset >= 0:
                start = int(tp.offset)
            elif uncommitted_at_end:
                start = high
            else:
                start = int(self._consumer.get_watermark_offsets(tp, timeout=timeout)[0])
            out[tp.partition] = (start, high, tp.metadata or "")
        return out

    def _partitions(self, topic: str, timeout: float) -> list[int]:
        """The topic's partitions, looked up again at most once a minute."""
        known = self._known.get(topic)
        if known is None or time.monotonic() - known[0] > 60:
            meta = self._consumer.list_topics(topic, timeout=timeout).topics[topic]
            if meta.error is not None:
                raise KafkaException(meta.error)
            known = self._known[topic] = (time.monotonic(), sorted(meta.partitions))
        return known[1]

    def close(self) -> None:
        self._consumer.close()


def high_watermarks(bootstrap: str, topic: str, partitions: list[int],
                    timeout: float = 10.0) -> dict[int, int]:
    """The true end of each partition, open transactions' records included (a
    read_committed client's watermark is the last stable offset instead)."""
    consumer = Consumer({**client_config(bootstrap), "group.id": "watermarks",
                         **client_logging("scan"),
                         "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
    try:
        return {p: int(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout,
                                                      cached=False)[1])
                for p in partitions}
    finally:
        consumer.close()


def read_spans(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
               timeout: float = 60.0) -> list[Record]:
    """The committed records of ``topic`` in ``[start, end)`` of each partition, in log
    order per partition. Records of transactions still open below ``end`` are waited
    for until their transaction commits (they are included) or aborts (they are not)."""
    return list(iter_spans(bootstrap, topic, spans, timeout))


def iter_spans(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
               timeout: float = 60.0) -> Generator[Record, None, None]:
    """``read_spans``, one record at a time as they are read: a long span is never held
    whole. ``timeout`` bounds a wait with no progress (a transaction left open below a
    span's end), not the whole read, which may be long."""
    todo = {p: span for p, span in spans.items() if span[0] < span[1]}
    if not todo:
        return
    consumer = Consumer({**client_config(bootstrap), "group.id": "scan",
                         **client_logging("scan"),
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         **NO_NAGLE})
    try:
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in todo.items()])
        positions = {p: start for p, (start, _) in todo.items()}
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} {sorted(todo)} made no progress "
                                   f"for {timeout:.0f} s")
            for record in _poll(consumer, 5000, 0.2):
                span = todo.get(record.position.partition)
                if span is not None and record.position.offset < span[1]:
                    yield record
            # Aborted records and transaction markers are never delivered: the position
            # tells when a partition's span has been read.
            for tp in consumer.position([TopicPartition(topic, p) for p in list(todo)]):
                if tp.offset > positions[tp.partition]:
                    positions[tp.partition] = tp.offset
                    deadline = time.monotonic() + timeout
                if tp.offset >= todo[tp.partition][1]:
                    del todo[tp.partition]
    finally:
        consumer.close()


def first_records(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
                  timeout: float = 60.0) -> dict[int, Record]:
    """The first committed record in ``[start, end)`` of each partition that has one (a
    consumer's committed offset may be a transaction marker's, or an aborted record's)."""
    found: dict[int, Record] = {}
    wanted = sum(start < end for start, end in spans.values())
    records = iter_spans(bootstrap, topic, spans, timeout)
    try:
        for record in records:
            found.setdefault(record.position.partition, record)
            if len(found) == wanted:
                break
    finally:
        records.close()
    return found


def scan_partitions(
    bootstrap: str, topic: str, partitions: list[int], since_ms: int | dict[int, int],
    timeout: float = 60.0, ends: dict[int, int] | None = None,
) -> Iterator[Record]:
    """Every committed record of ``topic``'s ``partitions`` from time ``since_ms`` (one for
    all, or per partition) to their true end now (or to ``ends``): a record written before
    the call is in the answer unless its transaction aborts. The span is fixed by the
    call; its records come one at a time (``iter_spans``)."""
    if not partitions:
        return iter(())
    if ends is None:
        ends = high_watermarks(bootstrap, topic, partitions)
    since = since_ms if isinstance(since_ms, dict) else dict.fromkeys(partitions, since_ms)
    consumer = Consumer({**client_config(bootstrap), "group.id": "scan",
                         **client_logging("scan"),
                         "enable.auto.commit": False})
    try:
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, since[p]) for p in partitions], timeout=timeout)
    finally:
        consumer.close()
    spans = {tp.partition: (int(tp.offset), ends[tp.partition]) for tp in starts
             if tp.offset >= 0}  # -1: nothing that recent
    return iter_spans(bootstrap, topic, spans, timeout)


# What a cluster answers a client it will not let in, or that cannot trust it.
ACCESS_ERRORS = {KafkaError._AUTHENTICATION, KafkaError._SSL,
                 KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError.ILLEGAL_SASL_STATE,
                 KafkaError.UNSUPPORTED_SASL_MECHANISM,
                 KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                 KafkaError.TOPIC_AUTHORIZATION_FAILED,
                 KafkaError.GROUP_AUTHORIZATION_FAILED}


def _refusal(err: KafkaError) -> bool:
    """An error that says the cluster will not take this client as configured: refused
    credentials or certificates, a TLS alert (no client certificate where one is
    required), or a listener of another protocol."""
    text = err.str()
    return err.code() in ACCESS_ERRORS or (err.code() == KafkaError._TRANSPORT and any(
        sign in text for sign in ("SSL handshake failed", "SSL routines", "security.protocol")))


def check_access(bootstrap: str, timeout: float = 15.0) -> bool:
    """Whether the cluster answers this process's clients, as configured: True once it
    answered, False if no broker answered (not this check's business: services wait for
    the cluster). Raises ``AccessRefused`` if the client properties cannot be used or the
    cluster refused the client (a wrong password, an untrusted certificate): a service
    that would otherwise retry forever stops at once with one line."""
    where = describe_listener(bootstrap)
    errors: list[KafkaError] = []
    try:
        # Its own log lines say what the one line raised says: kept quiet.
        quiet = logging.getLogger("librdkafka.access-check")
        quiet.setLevel(logging.CRITICAL + 1)
        config: dict[str, Any] = {**client_config(bootstrap), "logger": quiet,
                                  "log.connection.close": False, "error_cb": errors.append}
        admin = AdminClient(config)
    except KafkaException as exc:
        raise AccessRefused(f"the Kafka client settings for {where} cannot be used: "
                            f"{exc.args[0].str() if exc.args else exc}") from None
    deadline = time.monotonic() + timeout
    while True:
        admin.poll(0)
        refused = [e for e in errors if _refusal(e)]
        if refused:
            reason = refused[0].str().splitlines()[0]
            raise AccessRefused(f"Kafka refused this client at {where}: {reason}")
        if any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in errors):
            return False
        try:
            admin.list_topics(timeout=0.5)
            return True
        except KafkaException:
            if time.monotonic() > deadline:
                return False


def wait_for_broker(bootstrap: str, timeout: float = 60.0) -> None:
    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=2)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def set_scram_password(bootstrap: str, user: str, password: str,
                       mechanism: str = "SCRAM-SHA-512") -> None:
    """Creates or changes a SASL/SCRAM user's password (the cluster's credentials)."""
    # Re-exported by confluent_kafka.admin without being marked so (as NewTopic above).
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    info = ScramCredentialInfo(ScramMechanism[mechanism.replace("-", "_")], 8192)
    upsert = UserScramCredentialUpsertion(user, info, password.encode())
    for future in admin.alter_user_scram_credentials([upsert], request_timeout=30).values():
        future.result()


def delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    for fut in admin.delete_topics(names, operation_timeout=30).values():
        fut.result()


def broker_count(bootstrap: str, timeout: float = 10.0) -> int:
    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    return len(admin.list_topics(timeout=timeout).brokers)


def topic_limits(bootstrap: str, topics: Sequence[str], default: int,
                 timeout: float = 10.0) -> dict[str, int]:
    """Each topic's largest record (its ``max.message.bytes`` as the cluster has it): what
    a producer may send there. ``default`` for a topic the cluster does not say (a
    DescribeConfigs refused, say)."""
    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    out = dict.fromkeys(topics, default)
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t)
                                      for t in topics], request_timeout=timeout)
    for resource, future in futures.items():
        try:
            entry = future.result().get("max.message.bytes")
        except (KafkaException, ValueError) as exc:
            log.warning("could not read %s's record limit (taking %d bytes): %s",
                        resource.name, default, exc)
            continue
        if entry is not None and entry.value is not None:
            out[resource.name] = int(entry.value)
    return out


def _raise_limits(bootstrap: str, admin: AdminClient, specs: list[TopicSpec],
                  existing: set[str]) -> None:
    """Bring an existing topic's ``max.message.bytes`` up to its spec's (a topic made by an
    earlier version, at the broker's default): never lowered."""
    wanted = {s.name: int(s.config["max.message.bytes"]) for s in specs
              if s.name in existing and "max.message.bytes" in s.config}
    if not wanted:
        return
    limits = topic_limits(bootstrap, list(wanted), default=0)
    low = [name for name, limit in wanted.items() if limits.get(name, 0) < limit]
    if not low:
        return
    resources = []
    for name in low:
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        resource.add_incremental_config(ConfigEntry(
            "max.message.bytes", str(wanted[name]),
            incremental_operation=AlterConfigOpType.SET))
        resources.append(resource)
    for future in admin.incremental_alter_configs(resources).values():
        future.result()
    log.info("raised max.message.bytes of %s", ", ".join(low))


def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> list[str]:
    """Create missing topics; return the names created. Existing ones are left as they are,
    but for their record limit, which is raised to the spec's."""
    admin = AdminClient({**client_config(bootstrap), **client_logging("admin")})
    existing = set(admin.list_topics(timeout=10).topics)
    _raise_limits(bootstrap, admin, specs, existing)
    new = [
        NewTopic(s.name, num_partitions=s.partitions,
                 replication_factor=s.replication if s.replication is not None else -1,
                 config=s.config)
        for s in specs
        if s.name not in existing
    ]
    if not new:
        return []
    for fut in admin.create_topics(new, operation_timeout=30).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Wait until the new topics' metadata is visible, so producers don't race it.
    deadline = time.monotonic() + 30
    names = [t.topic for t in new]
    while time.monotonic() < deadline:
        topics = admin.list_topics(timeout=5).topics
        if all(n in topics and not topics[n].error and topics[n].partitions for n in names):
            break
        time.sleep(0.1)
    return names
