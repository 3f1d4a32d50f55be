"""``AsyncConsumer``: a consumer whose blocking calls run, one at a time, on a
dedicated thread, so an asyncio service can await them; ``GroupConsumer``, a member of
a consumer group (``pipeline.kafka.reader`` has the log reader)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import (
    Consumer,
    KafkaException,
    TopicPartition,
)

from pipeline.codec import TP
from pipeline.kafka.client import (
    BEGINNING,
    NO_NAGLE,
    QUEUE_REFILL,
    Record,
    client_config,
    client_logging,
    partition_ends,
    poll_records,
)

T = TypeVar("T")

# librdkafka adds a newly assigned partition to its fetches only once the long poll in
# flight returns (``fetch.wait.max.ms``, 500 ms by default). Consumers whose assignment
# changes, or whose paused partitions resume, while a client waits keep that poll short.
QUICK_ASSIGN = {"fetch.wait.max.ms": 10}
# Given the partitions just assigned, the offsets to start them at (None: the committed ones).
OnAssign = Callable[[list[TP]], dict[TP, int] | None]
OnRevoke = Callable[[list[TP]], None]

log = logging.getLogger(__name__)


class AsyncConsumer:
    """A confluent-kafka consumer driven from asyncio: what a group member
    (``GroupConsumer``) and a reader of the log by position (``LogReader``) share.

    Every call to the underlying consumer runs on one dedicated thread, so calls
    never overlap and rebalance callbacks run on that thread too.
    """

    def __init__(self, bootstrap: str, group_id: str, part: str, **extra: Any) -> None:
        config: dict[str, Any] = {
            **client_config(bootstrap, part),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            **NO_NAGLE,
            **QUEUE_REFILL,
            **client_logging("consumer"),
        }
        config.update(extra)
        self._consumer = Consumer(config)
        # Set once ``close`` begins: a rebalance callback the close itself serves (a join
        # still under way) must ask nothing more of a client being destroyed.
        self.closing = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kafka-consumer-{group_id}"
        )

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    # The methods below run on the consumer thread (from callbacks, or via ``call``).

    def poll_batch_sync(self, max_records: int, timeout: float) -> list[Record]:
        return poll_records(self._consumer, max_records, timeout)

    async def poll_batch(self, max_records: int, wait_s: float) -> list[Record]:
        return await self.call(self.poll_batch_sync, max_records, wait_s)

    def poll_window_sync(self, max_records: int, wait_s: float, window_s: float) -> list[Record]:
        """Up to ``max_records``: wait at most ``wait_s`` for the first, then gather what
        arrives for ``window_s`` after it, so a busy reader takes fewer, larger batches."""
        records = poll_records(self._consumer, max_records, wait_s)
        if not records:
            return records
        deadline = time.monotonic() + window_s
        while len(records) < max_records:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            records += poll_records(self._consumer, max_records - len(records), left)
        return records

    async def poll_window(self, max_records: int, wait_s: float,
                          window_s: float) -> list[Record]:
        return await self.call(self.poll_window_sync, max_records, wait_s, window_s)

    def _wake_fetcher(self, partitions: list[TopicPartition]) -> None:
        # One ListOffsets request to each leader of ``partitions`` wakes the threads that
        # serve them.
        with contextlib.suppress(KafkaException):  # only a wake-up: best effort
            partition_ends(self._consumer, [(tp.topic, tp.partition) for tp in partitions], 5)

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

    def watermarks_sync(self, topic: str, partition: int, timeout: float = 5.0) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout, cached=False
        )
        return int(low), int(high)

    def ends_sync(self, partitions: list[TP], timeout: float = 5.0) -> dict[TP, int]:
        """``partition_ends``: where ``watermarks`` asks one partition per request."""
        return partition_ends(self._consumer, partitions, timeout)

    def partitions_sync(self, topic: str, timeout: float = 10.0) -> list[int]:
        meta = self._consumer.list_topics(topic, timeout=timeout)
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise KafkaException(info.error if info else f"no topic {topic}")
        return sorted(info.partitions)

    # The same, awaited: each runs on the consumer's thread (``request_s``: how long
    # Kafka may take to answer, as ``timeout`` above).

    async def positions(self, partitions: list[TP] | None = None) -> dict[TP, int]:
        return await self.call(self.positions_sync, partitions)

    async def lag(self) -> dict[TP, int]:
        return await self.call(self.lag_sync)

    async def partitions(self, topic: str, request_s: float = 10.0) -> list[int]:
        return await self.call(self.partitions_sync, topic, request_s)

    async def watermarks(self, topic: str, partition: int,
                         request_s: float = 5.0) -> tuple[int, int]:
        return await self.call(self.watermarks_sync, topic, partition, request_s)

    async def ends(self, partitions: list[TP], request_s: float = 5.0) -> dict[TP, int]:
        return await self.call(self.ends_sync, partitions, request_s)

    async def close(self) -> None:
        self.closing = True
        try:
            await self.call(self._consumer.close)
        finally:
            self._executor.shutdown(wait=True)


class GroupConsumer(AsyncConsumer):
    """A member of a consumer group: it subscribes, is given partitions by the group
    (callbacks on the consumer's thread), commits the group's offsets, pauses and
    resumes, and rejoins."""

    def __init__(self, bootstrap: str, group_id: str, part: str, **extra: Any) -> None:
        super().__init__(bootstrap, group_id, part, **extra)
        # What ``subscribe`` was given, for ``rejoin_sync``.
        self._subscription: tuple[list[str], Callable[..., None], Callable[..., None]] | None = None


    def group_metadata_sync(self) -> Any:
        """The group's generation and this member's id, for transactions. Read it on the
        consumer's thread (in a rebalance callback): from another thread the call waits
        for the consumer's poll to return (measured: a fifth of a busy worker's time)."""
        return self._consumer.consumer_group_metadata()

    def subscribe(
        self, topics: list[str], on_assign: OnAssign | None = None,
        on_revoke: OnRevoke | None = None,
    ) -> None:
        """Join the group; the callbacks run on the consumer thread during a poll."""

        def assigned(consumer: Consumer, parts: list[TopicPartition]) -> None:
            if self.closing:  # served by ``close`` (a join under way): nothing to take
                return
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
        full to free). A ListOffsets request to each leader wakes the threads that serve
        them."""
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

    def assignment_sync(self) -> list[TP]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    # The same, awaited: each runs on the consumer's thread.

    async def rejoin(self) -> None:
        await self.call(self.rejoin_sync)

    async def pause(self, topic: str | None = None) -> None:
        await self.call(self.pause_sync, topic)

    async def resume(self, topic: str | None = None) -> None:
        await self.call(self.resume_sync, topic)

    async def restart_fetch(self, partitions: list[TP]) -> None:
        await self.call(self.restart_fetch_sync, partitions)


class StallWatch:
    """Restarts the fetch of partitions that have records waiting but have not moved for
    ``stall_s`` while fetching: a fetcher stuck after a leader change (seen in the outage
    suite; ``GroupConsumer.restart_fetch_sync``), or stopped for good once its brokers
    restarted (librdkafka #5153).

    The records waiting are counted from librdkafka's cached watermarks, which a fetch
    that stopped no longer updates: one that stopped while caught up shows none. So the
    end of a partition that seems caught up and has not moved for ``stall_s`` is asked of
    Kafka on ``ends`` (a client of its own, closed with the watch: never the group
    member's thread, which polls), in a task beside the caller's loop, which never waits
    for it; an answer past a position that has not moved since restarts that fetch too.
    One end that cannot be had in ``ASK_S`` ends that round's asking."""

    ASK_S = 1.0

    def __init__(self, consumer: GroupConsumer, ends: AsyncConsumer | None = None,
                 stall_s: float = 10.0) -> None:
        self.consumer, self.ends, self.stall_s = consumer, ends, stall_s
        self._progress: dict[TP, tuple[int | None, float]] = {}  # position, since when
        self._asking: asyncio.Task[dict[TP, tuple[int, int]]] | None = None

    async def check(self, lag: dict[TP, int], paused: bool) -> list[TP]:
        """``lag``: records waiting per partition (cached); ``paused``: not fetching them
        now. The partitions whose fetch was restarted."""
        now = time.monotonic()
        positions = await self.consumer.positions(list(lag))
        answered = self._answers()  # (position when asked, end) per partition
        stalled: list[TP] = []
        quiet: list[tuple[TP, int]] = []
        for tp, behind in lag.items():
            position = positions.get(tp)
            last = self._progress.get(tp)
            if paused or last is None or last[0] != position:
                self._progress[tp] = (position, now)
                continue
            asked = answered.get(tp)
            if asked is not None and position is not None and asked[0] == position < asked[1]:
                stalled.append(tp)  # records wait that its fetch never brought
            elif now - last[1] <= self.stall_s:
                continue
            elif behind > 0:
                stalled.append(tp)
            elif position is not None:
                quiet.append((tp, position))
            self._progress[tp] = (position, now)  # looked at again in ``stall_s``
        if quiet and self.ends is not None and self._asking is None:
            self._asking = asyncio.create_task(self._ask(quiet))
        if stalled:
            log.warning("partitions %s have records waiting but did not move for %.0f s: "
                        "restarting their fetch", stalled, self.stall_s)
            await self.consumer.restart_fetch(stalled)
        return stalled

    def _answers(self) -> dict[TP, tuple[int, int]]:
        if self._asking is None or not self._asking.done():
            return {}
        asking, self._asking = self._asking, None
        return {} if asking.cancelled() else asking.result()

    async def _ask(self, quiet: list[tuple[TP, int]]) -> dict[TP, tuple[int, int]]:
        assert self.ends is not None
        answered: dict[TP, tuple[int, int]] = {}
        for tp, position in quiet:
            try:
                answered[tp] = (position, (await self.ends.watermarks(*tp, self.ASK_S))[1])
            except Exception as exc:  # Kafka away (or no answer): asked again in ``stall_s``
                log.debug("no end of %s to check its fetch against: %r", tp, exc)
                break
        return answered

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # ``_ask`` raises nothing else
                await self._asking
        if self.ends is not None:
            await self.ends.close()
