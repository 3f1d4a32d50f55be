"""``EventProducer``: an idempotent, ``acks=all`` producer with its own poll thread;
``send`` returns an asyncio future that resolves once Kafka acknowledged the record."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import (
    KafkaError,
    KafkaException,
    Message,
    Producer,
)

from pipeline.codec import Position, bare, key_of
from pipeline.kafka.client import (
    RECORD_OVERHEAD,
    ProduceError,
    RecordTooLarge,
    client_logging,
    log_client_error,
    producer_config,
    resolve,
)
from pipeline.topics import DEADLETTER_HEADROOM
from schemas import Event

log = logging.getLogger(__name__)


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
        self._config = {**producer_config(bootstrap, linger_ms, timeout_ms, compression),
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
            # A delivery report ends the wait: an idle producer wakes 5 times a second.
            self._producer.poll(0.01 if self._overflow else 0.2)
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
        """``event``, which has no content (an event with content is encoded by the
        writer's codec and sent with ``send_raw``: ``pipeline.codec.bare``)."""
        return self.send_raw(topic, key_of(event), bare(event))

    def _on_error(self, err: KafkaError) -> None:
        log_client_error(err)
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
        partition: int | None = None,
    ) -> asyncio.Future[Position]:
        """Produce one record (to ``partition`` if given, else where its key goes)."""
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
            loop.call_soon_threadsafe(resolve, future, result)

        at = {} if partition is None else {"partition": partition}
        self._produce(topic, value=value, key=key, headers=list(headers), on_delivery=settle,
                      **at)
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

