"""Plain clients for small records a caller keeps itself: workers' heartbeats, rollout
records, key-revocation cancellations, a bench's prompts. Synchronous, called from one
thread, outside any consumer group's assignment (a reader is given its partitions).
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from pipeline.codec import TP
from pipeline.kafka.client import (
    BEGINNING,
    QUEUE_REFILL,
    ProduceError,
    Record,
    client_config,
    client_logging,
    partition_ends,
    poll_records,
)
from pipeline.kafka.clock import BrokerClock

END = OFFSET_END


class PlainWriter:
    """A producer of side records. ``durable``: idempotent and ``acks=all`` (records that
    must not be lost); otherwise a lost record is harmless (a heartbeat). Records whose
    delivery failed are listed by ``take_failures``; those delivered to a topic its
    broker stamps read the brokers' clock into ``clock``, if given."""

    def __init__(self, bootstrap: str, name: str, *, durable: bool = True,
                 linger_ms: float = 5.0, timeout_s: float | None = None,
                 compression: str = "none", clock: BrokerClock | None = None) -> None:
        config: dict[str, Any] = {**client_config(bootstrap, "plain-writer"),
                                  "linger.ms": linger_ms,
                                  "compression.type": compression,
                                  # the Java client's partitioner: every client agrees
                                  # where a key lives
                                  "partitioner": "murmur2_random", **client_logging(name)}
        if durable:
            config |= {"acks": "all", "enable.idempotence": True}
        if timeout_s is not None:
            config["message.timeout.ms"] = int(timeout_s * 1000)
        self._producer = Producer(config)
        self._failures: list[str] = []
        self._clock = clock

    def send(self, topic: str, key: bytes | None, value: bytes | None,
             partition: int | None = None) -> None:
        """Queue a record (``value`` None: a tombstone), to ``partition`` if given (else
        where its key goes). Raises ProduceError if the client's queue cannot take it."""
        try:
            if partition is None:
                self._producer.produce(topic, key=key, value=value,
                                       on_delivery=self._delivered)
            else:
                self._producer.produce(topic, key=key, value=value, partition=partition,
                                       on_delivery=self._delivered)
        except (BufferError, KafkaException) as exc:
            raise ProduceError(f"not queued: {exc}") from exc

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._failures.append(str(err))
        elif self._clock is not None:
            self._clock.observe(msg)

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery reports that have arrived, waiting at most ``timeout`` for one."""
        self._producer.poll(timeout)

    def take_failures(self) -> list[str]:
        failures, self._failures = self._failures, []
        return failures

    def flush(self, timeout: float = 30.0) -> list[str]:
        """Wait until every queued record is acknowledged or ``timeout`` passes; what
        was not acknowledged (failed, or still waiting)."""
        left = self._producer.flush(timeout)
        return self.take_failures() + [f"{left} not acknowledged in {timeout:g} s"] * bool(left)


class PlainReader:
    """A consumer of partitions it is given (not a group's). ``committed_only``: records
    of transactions not (yet) committed are skipped."""

    def __init__(self, bootstrap: str, name: str, *, committed_only: bool = True) -> None:
        self._consumer = Consumer({
            **client_config(bootstrap, "plain-reader"), "group.id": name,
            "enable.auto.commit": False,
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
            **QUEUE_REFILL, **client_logging(name)})

    def start(self, positions: dict[TP, int]) -> None:
        """Read these partitions from these offsets (``BEGINNING``, ``END``, or one)."""
        self._consumer.assign([TopicPartition(t, p, o) for (t, p), o in positions.items()])

    def start_at_time(self, topic: str, ms: int, timeout: float = 10.0) -> None:
        """Read every partition of ``topic`` from its first record written at ``ms``
        (epoch milliseconds) or later (its end if none is)."""
        found = self._consumer.offsets_for_times(
            [TopicPartition(topic, p, ms) for p in self.partitions(topic, timeout)],
            timeout=timeout)
        self.start({(tp.topic, tp.partition): tp.offset if tp.offset >= 0 else END
                    for tp in found})

    def partitions(self, topic: str, timeout: float = 10.0) -> list[int]:
        return sorted(self._consumer.list_topics(topic, timeout=timeout)
                      .topics[topic].partitions)

    def end(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        """The partition's high watermark."""
        return self.bounds(topic, partition, timeout)[1]

    def bounds(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """The partition's first offset and its high watermark. (A reader started at a
        concrete offset reads at once; one started at ``BEGINNING`` waits half a second
        for librdkafka to look the offset up.)"""
        low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                         timeout=timeout)
        return int(low), int(high)

    def ends(self, topic: str, partitions: list[int], timeout: float = 10.0
             ) -> dict[int, int]:
        """The partitions' ends as they are now (``partition_ends``): ``bounds`` asks the
        first offset too, in a request of its own each."""
        return {p: end for (_, p), end in partition_ends(
            self._consumer, [(topic, p) for p in partitions], timeout).items()}

    def position(self, topic: str, partition: int) -> int:
        """The next offset this reader reads in the partition (negative: none yet)."""
        return int(self._consumer.position([TopicPartition(topic, partition)])[0].offset)

    def read(self, max_records: int = 1000, timeout: float = 0.0) -> list[Record]:
        """What has arrived: wait at most ``timeout`` for the first record."""
        return poll_records(self._consumer, max_records, timeout)

    def close(self) -> None:
        self._consumer.close()


__all__ = ["BEGINNING", "END", "PlainReader", "PlainWriter"]
