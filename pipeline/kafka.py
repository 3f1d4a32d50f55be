"""The Kafka adapter: the only module that imports confluent_kafka.

* ``EventProducer``: idempotent, ``acks=all`` producer with its own poll thread;
  ``send`` returns an asyncio future that resolves once Kafka acknowledged the record.
* ``AsyncConsumer``: a consumer whose blocking calls run, one at a time, on a
  dedicated thread, so an asyncio service can await them.
* ``ensure_topics`` / ``wait_for_broker``: administration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
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
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from pipeline.codec import Position, encode, key_of
from pipeline.topics import TopicSpec
from schemas import Event

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["AsyncConsumer", "EventProducer", "GroupStatus", "KafkaException", "ProduceError",
           "Record"]


@dataclass(frozen=True)
class Record:
    position: Position
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


class ProduceError(RuntimeError):
    """Kafka did not acknowledge a record."""


# librdkafka leaves Nagle's algorithm on. A turn's first events then waited for the
# previous request's TCP acknowledgement: measured here, up to 265 ms between a worker
# producing a turn's first token and the gateway reading it (3-6 ms without Nagle).
NO_NAGLE = {"socket.nagle.disable": True}


def _producer_config(bootstrap: str, linger_ms: float) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": True,
        # A record that fails for good makes the producer fail every later one (a fatal
        # error) rather than leave a gap: a record not awaited (send_nowait) can only be
        # lost if the awaited ones after it are refused too.
        "enable.gapless.guarantee": True,
        "linger.ms": linger_ms,
        # The Java client's partitioner, so every client agrees where a key lives.
        "partitioner": "murmur2_random",
        "message.timeout.ms": 30_000,
        **NO_NAGLE,
    }


def _log_client_error(err: KafkaError) -> None:
    if err.fatal():
        log.error("the Kafka producer failed for good: %s", err)
    else:
        log.warning("Kafka client error (retried): %s", err)


class EventProducer:
    """Produces events; ``send`` resolves once the record is durable in Kafka;
    ``send_nowait`` is for records nobody waits for (token deltas): no future, no
    wake-up of the event loop per acknowledgement."""

    def __init__(self, bootstrap: str, *, linger_ms: float = 1.0) -> None:
        # No delivery callback for records nobody awaits: each would take the GIL from
        # the event loop on the poll thread (measured: a vLLM worker's inter-token
        # latency at 1 client went from 2.8 to 1.9 ms without them). A refused one stops
        # the producer (gapless guarantee), so the turn's awaited end fails visibly.
        self._producer = Producer({**_producer_config(bootstrap, linger_ms),
                                   "error_cb": _log_client_error})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kafka-producer-poll", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)

    def send(self, topic: str, event: Event) -> asyncio.Future[Position]:
        return self.send_raw(topic, key_of(event), encode(event))

    def send_nowait(self, topic: str, event: Event) -> None:
        """Produce ``event`` with no acknowledgement to wait for."""
        self._produce(topic, value=encode(event), key=key_of(event))

    def _produce(self, topic: str, **record: Any) -> None:
        while True:
            try:
                self._producer.produce(topic, **record)
                return
            except BufferError:
                # The local queue is full: wait for deliveries rather than drop the record.
                self._producer.poll(0.01)

    def send_raw(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> asyncio.Future[Position]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Position] = loop.create_future()

        def settle(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                result: Position | BaseException = ProduceError(str(err))
            else:
                result = Position(msg.topic() or topic, msg.partition() or 0, msg.offset() or 0)
            loop.call_soon_threadsafe(_resolve, future, result)

        self._produce(topic, value=value, key=key, headers=list(headers), on_delivery=settle)
        return future

    def flush(self, timeout: float = 30.0) -> int:
        return int(self._producer.flush(timeout))

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
            if err.fatal() or not err.retriable():
                raise KafkaException(err)
            log.warning("transient consumer error: %s", err)
            continue
        _, ts = msg.timestamp()
        records.append(Record(
            Position(msg.topic() or "", msg.partition() or 0, msg.offset() or 0),
            msg.key(), msg.value(), ts,
        ))
    return records


def _resolve(future: asyncio.Future[Position], result: Position | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


TP = tuple[str, int]
# librdkafka adds a newly assigned partition to its fetches only once the long poll in
# flight returns (``fetch.wait.max.ms``, 500 ms by default). Consumers whose assignment
# changes, or whose paused partitions resume, while a client waits keep that poll short.
QUICK_ASSIGN = {"fetch.wait.max.ms": 10}
# Given the partitions just assigned, the offsets to start them at (None: the committed ones).
OnAssign = Callable[[list[TP]], dict[TP, int] | None]
OnRevoke = Callable[[list[TP]], None]
BEGINNING = OFFSET_BEGINNING


class AsyncConsumer:
    """A confluent-kafka consumer driven from asyncio.

    Every call to the underlying consumer runs on one dedicated thread, so calls
    never overlap and rebalance callbacks run on that thread too.
    """

    def __init__(self, bootstrap: str, group_id: str, **extra: Any) -> None:
        config: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            **NO_NAGLE,
        }
        config.update(extra)
        self._consumer = Consumer(config)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kafka-consumer-{group_id}"
        )

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

        self._consumer.subscribe(topics, on_assign=assigned, on_revoke=revoked)

    # The methods below run on the consumer thread (from callbacks, or via ``call``).

    def poll_batch_sync(self, max_records: int, timeout: float) -> list[Record]:
        return _poll(self._consumer, max_records, timeout)

    async def poll_batch(self, max_records: int, wait_s: float) -> list[Record]:
        return await self.call(self.poll_batch_sync, max_records, wait_s)

    def commit_sync(self, offsets: dict[tuple[str, int], int]) -> None:
        """Commit ``next offset to read`` per (topic, partition); blocks until done."""
        if offsets:
            parts = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
            self._consumer.commit(offsets=parts, asynchronous=False)

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        if offsets:
            await self.call(self.commit_sync, offsets)

    def pause_all_sync(self) -> None:
        self._consumer.pause(self._consumer.assignment())

    def resume_all_sync(self) -> None:
        """Resume every assigned partition, and have its fetches start now. librdkafka's
        fetcher notices a resumed partition when the broker thread serving it next wakes:
        up to a second later when it fetches nothing else (measured: a full worker's next
        prompts waited 600 ms at every turn from full to free). A ListOffsets request for
        each partition wakes the thread that serves it."""
        partitions = self._consumer.assignment()
        self._consumer.resume(partitions)
        self._wake_fetcher(partitions)

    def _wake_fetcher(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            with contextlib.suppress(KafkaException):  # only a wake-up: best effort
                self._consumer.get_watermark_offsets(tp, timeout=5, cached=False)

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
        place), fetching them at once (see ``resume_all_sync``)."""
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


class GroupStatus:
    """A consumer group seen from outside, without joining it: how far it is behind the
    end of a topic (its committed offsets), and its live members' client ids."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self._group = group
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                   "enable.auto.commit": False})
        self._admin = AdminClient({"bootstrap.servers": bootstrap})

    def client_ids(self, timeout: float = 5.0) -> list[str]:
        futures = self._admin.describe_consumer_groups([self._group], request_timeout=timeout)
        return [m.client_id for m in futures[self._group].result().members]

    def per_partition(self, topic: str, timeout: float = 5.0) -> dict[int, tuple[int, int]]:
        """Per partition: (committed offset, end offset); a partition the group never
        committed counts from its start."""
        meta = self._consumer.list_topics(topic, timeout=timeout).topics[topic]
        parts = [TopicPartition(topic, p) for p in sorted(meta.partitions)]
        out = {}
        for tp in self._consumer.committed(parts, timeout=timeout):
            low, high = self._consumer.get_watermark_offsets(tp, timeout=timeout)
            committed = tp.offset if tp.offset >= 0 else low
            out[tp.partition] = (int(committed), int(high))
        return out

    def close(self) -> None:
        self._consumer.close()


def scan_partitions(
    bootstrap: str, topic: str, partitions: list[int], since_ms: int, timeout: float = 60.0
) -> list[Record]:
    """Every record of ``topic``'s ``partitions`` from time ``since_ms`` to their current end."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "scan",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        starts = consumer.offsets_for_times(
            [TopicPartition(topic, p, since_ms) for p in partitions], timeout=timeout)
        ends: dict[int, int] = {}
        assignment = []
        for tp in starts:
            _, high = consumer.get_watermark_offsets(tp, timeout=timeout)
            if tp.offset >= 0 and tp.offset < high:  # -1: nothing that recent
                ends[tp.partition] = high
                assignment.append(tp)
        consumer.assign(assignment)
        records: list[Record] = []
        deadline = time.monotonic() + timeout
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"scan of {topic} {partitions} did not finish")
            for record in _poll(consumer, 5000, 0.5):
                records.append(record)
                if record.position.offset + 1 >= ends.get(record.position.partition, 0):
                    ends.pop(record.position.partition, None)
        return records
    finally:
        consumer.close()


def wait_for_broker(bootstrap: str, timeout: float = 60.0) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=2)
            return
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def delete_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(names, operation_timeout=30).values():
        fut.result()


def ensure_topics(bootstrap: str, specs: list[TopicSpec]) -> list[str]:
    """Create missing topics; return the names created. Existing ones are left as they are."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = set(admin.list_topics(timeout=10).topics)
    new = [
        NewTopic(s.name, num_partitions=s.partitions, replication_factor=1, config=s.config)
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
