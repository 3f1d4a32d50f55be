"""What every Kafka client shares: the records it reads and writes, its configuration
(the operator's properties, no Nagle), its logging, and the poll that turns messages
into ``Record``s."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)

from pipeline.codec import TP, Position
from pipeline.kafka.config import client_properties
from pipeline.retry import QuietLog, RepeatFilter

log = logging.getLogger(__name__)


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


BEGINNING = OFFSET_BEGINNING
# As a ListOffsets timestamp (``offsets_for_times``): a partition's end.
LATEST = -1


# Which service this process runs (``name_clients``): the first half of its clients' ids.
_service = {"name": "pipeline"}


def name_clients(service: str) -> None:
    """Name this process's Kafka clients after ``service`` (the command it runs)."""
    _service["name"] = service


def client_id(part: str) -> str:
    """A client's ``client.id``: ``chat-<service>/<part>``, a handful per service, so that
    the broker's request logs, its per-client metrics and its quotas tell the services
    and their clients apart (all were ``rdkafka``)."""
    return f"chat-{_service['name']}/{part}"


# librdkafka's producers ask the broker to make a topic they name that does not exist, and
# a broker that does (``auto.create.topics.enable``, Kafka's default) makes it with its
# own defaults: a ``chat.keys`` deleting keys after 7 days, say. Only ``pipeline topics``
# makes topics (``pipeline.topicconfig``).
NO_AUTO_CREATE = {"allow.auto.create.topics": False}


def client_config(bootstrap: str, part: str) -> dict[str, Any]:
    """What every Kafka client starts from: its id (``client_id``; a ``client.id`` the
    operator's properties set is kept instead, for quotas of their own), the cluster's
    address and the operator's client properties (``PIPELINE_KAFKA_CONFIG``: TLS, SASL)."""
    named = {"client.id": client_id(part)}
    return {**named, **client_properties(), "bootstrap.servers": bootstrap, **NO_AUTO_CREATE}


# librdkafka stops fetching a partition while its local queue holds
# ``queued.min.messages`` records or ``queued.max.messages.kbytes``, and then looks again
# only after ``fetch.queue.backoff.ms``, 1 s by default: a reader that drains its queue
# sooner (a small queue, a scan that skips most of what it reads) waited out the rest of
# that second with nothing to read. Measured here, a look-up of 20 keys through 2 MB of a
# partition took 1.015 s, every time, with its 256 kB queue; 0.02-0.04 s looking again
# after 1 ms. Looking again costs a little while the queue stays full (a reader behind
# on six partitions: 0.6% of a core at 10 ms, 3.6% at 1 ms), so a consumer that keeps
# its partitions takes 10 ms; one assigned only while it reads (``PositionReader``), 1.
QUEUE_REFILL = {"fetch.queue.backoff.ms": 10}

# librdkafka leaves Nagle's algorithm on. A turn's first events then waited for the
# previous request's TCP acknowledgement: measured here, up to 265 ms between a worker
# producing a turn's first token and the gateway reading it (3-6 ms without Nagle).
NO_NAGLE = {"socket.nagle.disable": True}


def producer_config(bootstrap: str, linger_ms: float, timeout_ms: int,
                     compression: str) -> dict[str, Any]:
    return {
        **client_config(bootstrap, "producer"),
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


client_errors = QuietLog(log, every_s=30.0)
consumer_errors = QuietLog(log, every_s=30.0)


def log_client_error(err: KafkaError) -> None:
    if err.fatal():
        log.error("a Kafka client failed for good: %s", err)
    else:
        client_errors.warning("Kafka client error (retried): %s", err)


def client_logging(name: str) -> dict[str, Any]:
    """librdkafka's own log lines through Python logging, each shape of message at most
    once per 30 s (a broker away logged a line per connection attempt: 10,644 in 2.5
    minutes), and its client errors likewise."""
    logger = logging.getLogger(f"librdkafka.{name}")
    if not any(isinstance(f, RepeatFilter) for f in logger.filters):
        logger.addFilter(RepeatFilter(every_s=30.0))
    return {"logger": logger, "error_cb": log_client_error, "log.connection.close": False}


def poll_records(consumer: Consumer, max_records: int, timeout: float) -> list[Record]:
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
            consumer_errors.warning("consumer error (it recovers by itself): %s", err)
            continue
        _, ts = msg.timestamp()
        records.append(Record(
            Position(msg.topic() or "", msg.partition() or 0, msg.offset() or 0),
            msg.key(), msg.value(), ts, headers_of(msg),
        ))
    return records


def partition_ends(consumer: Consumer, partitions: list[TP], timeout: float
                   ) -> dict[TP, int]:
    """The partitions' ends as they are now (the last stable offset, for a reader of
    committed records only), any topics and partitions in one ListOffsets request to
    each leader, where a watermark query asks one partition per request (and its first
    offset in another)."""
    if not partitions:
        return {}
    found = consumer.offsets_for_times(
        [TopicPartition(t, p, OFFSET_END) for t, p in partitions], timeout=timeout)
    for tp in found:
        if tp.error is not None:
            raise KafkaException(tp.error)
    return {(tp.topic, tp.partition): int(tp.offset) for tp in found}


def headers_of(msg: Message) -> list[tuple[str, str | bytes | None]] | None:
    headers = msg.headers()
    return list(headers.items()) if isinstance(headers, dict) else headers


def resolve(future: asyncio.Future[Position], result: Position | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)




# Errors that say the cluster did not answer, not that this one call was wrong.
_UNREACHABLE = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
                KafkaError._RESOLVE, KafkaError._MSG_TIMED_OUT, KafkaError.REQUEST_TIMED_OUT,
                KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE}


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the cluster did not answer (as opposed to refusing a call)."""
    return (isinstance(exc, KafkaException) and bool(exc.args)
            and isinstance(exc.args[0], KafkaError) and exc.args[0].code() in _UNREACHABLE)


# What a broker answers when the client's idea of a partition's leader is out of date
# (the leader moved, a broker was paused or restarted): the call was refused before it
# did anything, and asked again once the client has refreshed its metadata (which this
# answer makes it do), it is answered.
_STALE_LEADER = {KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
                 KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                 KafkaError.OFFSET_NOT_AVAILABLE}


def stale_leader(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal that the same call, asked again, gets past."""
    return (isinstance(exc, KafkaException) and bool(exc.args)
            and isinstance(exc.args[0], KafkaError) and exc.args[0].code() in _STALE_LEADER)
