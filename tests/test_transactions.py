"""The worker's writes are fenced by its consumer group (KIP-447), against the real broker:
once a member has left the group, a transaction that shows the broker its old group
metadata is refused, and its records never reach a read_committed reader. And its reads
go on: a prompt partition whose fetch stopped is found once records wait there."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid

import pytest
from confluent_kafka import Producer, TopicPartition

from pipeline.codec import CLEAR
from pipeline.kafka import (
    Fenced,
    GroupConsumer,
    LogReader,
    RecordTooLarge,
    StallWatch,
    TransactionalProducer,
    TransactionSettings,
    ensure_topics,
)
from pipeline.topics import GENERATIONS, LIVE, TopicSpec
from schemas import GenerationFinished, GenerationStarted, SessionCreated, Usage
from tests.conftest import Stack
from tests.logread import read_records
from workers.output import Output

pytestmark = pytest.mark.integration


async def _assigned(bootstrap: str, group: str, source: str, **config: object
                    ) -> GroupConsumer:
    """A member of ``group`` subscribed to ``source``, once the group has assigned it."""
    member = GroupConsumer(bootstrap, group, "test", **config)
    member.subscribe([source])
    deadline = time.monotonic() + 30
    while not await member.call(member.assignment_sync):
        assert time.monotonic() < deadline, f"{group}: never assigned"
        await member.poll_batch(1, 0.2)
    return member


def test_a_writer_whose_member_left_the_group_is_refused(sim_stack: Stack) -> None:
    suffix = uuid.uuid4().hex[:8]
    source, sink, group = f"fence.in.{suffix}", f"fence.out.{suffix}", f"fence-{suffix}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(source, 1, {}), TopicSpec(sink, 1, {})])

    async def scenario() -> tuple[list[str], list[bool]]:
        shown: list[bool] = []  # per refusal: it names the group metadata the writer had

        def on_fenced(_answered: bool, group: object) -> None:
            shown.append(group is metadata)

        member = await _assigned(sim_stack.bootstrap, group, source,
                                 **{"session.timeout.ms": 6000})
        writer = TransactionalProducer(
            sim_stack.bootstrap, f"fence-writer-{suffix}", TransactionSettings(timeout_ms=10_000),
            lambda: {(source, 0): 0}, on_committed=lambda _: None, on_fenced=on_fenced)
        await asyncio.to_thread(writer.start)
        metadata = await member.call(member.group_metadata_sync)
        writer.set_group(metadata)

        def event(name: str) -> SessionCreated:  # no content: sent bare
            return SessionCreated(conversation_id=uuid.uuid4(), request_id=name)

        await writer.send(sink, event("while a member"), writer.epoch)
        # The member leaves and another takes the partition: the writer is now a zombie.
        await member.close()
        successor = await _assigned(sim_stack.bootstrap, group, source)
        outcomes = []
        for title in ("after leaving", "and again"):
            try:
                await writer.send(sink, event(title), writer.epoch)
                outcomes.append("committed")
            except Fenced:
                outcomes.append("refused")
        await asyncio.to_thread(writer.close)
        await successor.close()
        return outcomes, shown

    outcomes, shown = asyncio.run(scenario())
    assert outcomes == ["refused", "refused"] and shown and all(shown), shown
    committed = [v for _, v, _ in read_records(sim_stack.bootstrap, sink)]
    everything = [v for _, v, _ in read_records(sim_stack.bootstrap, sink, committed=False)]
    assert [b"while a member" in v for v in committed] == [True]
    assert any(b"after leaving" in v for v in everything)  # written, then aborted


def test_transactions_begin_no_closer_than_the_interval_and_lose_nothing(
        sim_stack: Stack) -> None:
    """Records sent every 20 ms to a producer with a 200 ms floor between transactions:
    they share a few transactions, and every one is written, in order."""
    sink = f"interval.out.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario() -> tuple[int, float]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"interval-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(interval_ms=200))
        writer.start()
        assert await asyncio.to_thread(writer.ready.wait, 60), "never registered"
        started = time.monotonic()
        sent = []
        for i in range(50):
            sent.append(writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                         request_id=f"r{i}")))
            await asyncio.sleep(0.02)  # 1 s in all: several 200 ms floors
        await asyncio.gather(*sent)
        elapsed = time.monotonic() - started
        writer.close()
        return writer.transactions, elapsed

    transactions, elapsed = asyncio.run(scenario())
    assert transactions <= elapsed / 0.2 + 1, (transactions, elapsed)
    assert transactions >= 2  # the floor spaces transactions, it does not hold records
    written = [value for _, value, _ in read_records(sim_stack.bootstrap, sink)]
    assert [v.split(b'"request_id":"')[1].split(b'"')[0] for v in written] == \
        [f"r{i}".encode() for i in range(50)]


def test_a_sender_that_gathers_gets_one_transaction_for_each_burst_it_says_is_in(
        sim_stack: Stack) -> None:
    """Bursts of records queued over some 60 ms each (a worker's turns emitting one
    engine step), each followed by ``gathered``: one transaction per burst, where a
    transaction begun on the first record would take part of it and leave the rest for
    the next. A record never followed by ``gathered`` waits for it no longer than the
    interval."""
    sink = f"gathered.out.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario(gathers: bool) -> tuple[int, float]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"gathered-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(interval_ms=500, gathers=gathers))
        writer.start()
        assert await asyncio.to_thread(writer.ready.wait, 60), "never registered"
        sent = []
        for burst in range(4):
            for i in range(20):
                sent.append(writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                             request_id=f"{gathers}-{burst}-{i}")))
                await asyncio.sleep(0.003)
            writer.gathered()
            await asyncio.sleep(0.6)  # past the interval: the next burst may begin one
        await asyncio.gather(*sent)
        bursts = writer.transactions
        started = time.monotonic()
        await writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                               request_id=f"{gathers}-alone"))
        alone_s = time.monotonic() - started
        await asyncio.to_thread(writer.close)
        return bursts, alone_s

    gathered, alone_s = asyncio.run(scenario(True))
    ungathered, _ = asyncio.run(scenario(False))
    assert gathered == 4, gathered
    assert ungathered > 4  # each burst's first record begins a transaction of its own
    assert 0.4 < alone_s < 5, alone_s  # held for the interval, then written
    written = [v.split(b'"request_id":"')[1].split(b'"')[0]
               for _, v, _ in read_records(sim_stack.bootstrap, sink)]
    for gathers in (True, False):
        assert [w for w in written if w.startswith(f"{gathers}-".encode())] == \
            [f"{gathers}-{b}-{i}".encode() for b in range(4) for i in range(20)] + \
            [f"{gathers}-alone".encode()]


def test_an_outbox_tells_a_sender_when_a_transaction_could_take_its_records() -> None:
    """``begins_in``: at once with no transaction made yet; None while one is being made;
    then what is left of the spacing since it began. ``when_free`` calls the sender back
    on its loop once that transaction is given back, or once the outbox stops, and says
    False when no transaction is being made."""
    from pipeline.kafka.outbox import Outbox, Pacing, Queued, RecordLimits

    def take(outbox: Outbox) -> None:  # what the transaction loop does, up to its begin
        outbox.put([Queued(0, "t", b"k", b"v", [], None)])
        outbox.gathered()
        assert outbox.next_batch(lambda: True)
        with outbox.cond:
            outbox.began(time.monotonic())

    def give_back(outbox: Outbox) -> None:
        with outbox.cond:
            outbox.give_back([])

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        outbox = Outbox(RecordLimits(1000, {}), Pacing(0.3, True), 100)
        assert outbox.begins_in() == 0.0
        assert not outbox.when_free(lambda: pytest.fail("no transaction was being made"))
        await asyncio.to_thread(take, outbox)
        assert outbox.begins_in() is None
        freed: asyncio.Future[float] = loop.create_future()
        assert outbox.when_free(lambda: freed.set_result(time.monotonic()))
        loop.call_later(0.05, lambda: threading.Thread(target=give_back, args=(outbox,)).start())
        await asyncio.wait_for(freed, 5)
        left = outbox.begins_in()
        assert left is not None and 0.1 < left <= 0.3, left
        await asyncio.to_thread(take, outbox)
        stopped: asyncio.Future[None] = loop.create_future()
        assert outbox.when_free(lambda: stopped.set_result(None))
        await asyncio.to_thread(outbox.stop)
        await asyncio.wait_for(stopped, 5)
        assert not outbox.when_free(lambda: pytest.fail("the outbox stopped"))

    asyncio.run(scenario())


def test_a_sender_waits_for_room_while_the_log_takes_records_slower_than_they_come(
        sim_stack: Stack) -> None:
    """A worker's turns stop queueing tokens past ``max_queued`` records: a flood of
    deltas grew a worker past 10 GB while its transactions fell behind. ``room()`` waits
    until a transaction has taken the queue, and every record is written, in order."""
    sink = f"room.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario() -> tuple[bool, bool]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"room-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(max_queued=50))
        for i in range(50):  # not started yet: nothing takes them
            writer.send_nowait(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                    request_id=f"r{i}"))
        full = writer.backlogged
        waiting = asyncio.ensure_future(writer.room())
        await asyncio.sleep(0.5)
        still = not waiting.done()
        await asyncio.to_thread(writer.start)
        await asyncio.wait_for(waiting, 30)
        await asyncio.to_thread(writer.close, 30)
        return full, still

    full, waited = asyncio.run(scenario())
    assert full and waited
    values = [value or b"" for _, value, _ in read_records(sim_stack.bootstrap, sink)]
    assert len(values) == 50
    assert all(f'"request_id":"r{i}"'.encode() in value for i, value in enumerate(values))


def test_records_dropped_while_a_transaction_waits_for_its_floor_leave_the_writer_working(
        sim_stack: Stack) -> None:
    """A worker that gives turns up (``new_epoch``) while its next transaction waits out
    the floor: the transaction thread found its queue empty after the wait and returned
    for good, so every later record queued forever and the worker's turns hung (found by
    the suite with the 20 ms floor on). Later records are written."""
    sink = f"dropped.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario() -> list[str]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"dropped-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(interval_ms=1000))
        writer.start()
        assert await asyncio.to_thread(writer.ready.wait, 60), "never registered"
        outcomes = []
        await writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(), request_id="r0"))
        given_up = writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                    request_id="r1"))
        await asyncio.sleep(0.3)  # the thread is waiting out the floor
        epoch = writer.new_epoch()
        try:
            await given_up
        except Fenced:
            outcomes.append("dropped")
        await asyncio.sleep(1.0)  # the floor has passed, with nothing queued
        await asyncio.wait_for(writer.send(sink, SessionCreated(
            conversation_id=uuid.uuid4(), request_id="r2"), epoch), 30)
        outcomes.append("written")
        await asyncio.to_thread(writer.close)
        return outcomes

    assert asyncio.run(scenario()) == ["dropped", "written"]
    written = [value for _, value, _ in read_records(sim_stack.bootstrap, sink)]
    assert [v.split(b'"request_id":"')[1].split(b'"')[0] for v in written] == [b"r0", b"r2"]


class _Hanging(Producer):
    """A real producer whose calls hang as librdkafka's that ignore their timeout can
    (librdkafka #5456): the first one made hangs in its registration; the second one's
    first transaction fails its flush, and its abort hangs; the third one's commit hangs.
    Each returns on ``release``."""

    made = 0
    release = threading.Event()

    def __init__(self, config: dict[str, object]) -> None:
        super().__init__(config)
        _Hanging.made += 1
        self.number, self.flushed = _Hanging.made, False

    def init_transactions(self, *args: object) -> None:
        if self.number == 1:
            _Hanging.release.wait(120)
        super().init_transactions(*args)

    def flush(self, *args: object) -> int:
        if self.number == 2 and not self.flushed:
            self.flushed = True
            return 1  # a record not delivered: the transaction is aborted
        return super().flush(*args)

    def abort_transaction(self, *args: object) -> None:
        if self.number == 2:
            _Hanging.release.wait(120)
        super().abort_transaction(*args)

    def commit_transaction(self, *args: object) -> None:
        if self.number == 3:
            _Hanging.release.wait(120)
        super().commit_transaction(*args)


def test_a_producer_stuck_outside_a_transaction_is_replaced_and_loses_nothing(
        sim_stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog replaced a producer stuck in a transaction's steps, but not one stuck
    registering its id (a writer that never started), committing or aborting (one that
    never wrote again). Here the first producer hangs registering, the second aborting,
    the third committing; each is replaced past its call's timeout, and every record is
    written once. The stuck calls then return, and their abandoned threads do nothing
    more."""
    import pipeline.kafka.transaction_loop as transaction_loop

    monkeypatch.setattr(transaction_loop, "Producer", _Hanging)
    _Hanging.made = 0
    _Hanging.release.clear()
    sink = f"hanging.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario() -> float:
        writer = TransactionalProducer(sim_stack.bootstrap, f"hanging-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(timeout_ms=2000))
        started = time.monotonic()
        writer.start()
        sent = [writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                 request_id=f"r{i}")) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*sent), 60)
        took = time.monotonic() - started
        _Hanging.release.set()
        await asyncio.sleep(1)  # the abandoned threads' calls return
        await writer.send(sink, SessionCreated(conversation_id=uuid.uuid4(), request_id="r5"))
        await asyncio.to_thread(writer.close, 30)
        return took

    took = asyncio.run(scenario())
    assert _Hanging.made >= 4 and took > 8  # registering: 3 x 2 s its own, 2 s more
    written = [value or b"" for _, value, _ in read_records(sim_stack.bootstrap, sink)]
    assert [v.split(b'"request_id":"')[1].split(b'"')[0] for v in written] == \
        [f"r{i}".encode() for i in range(6)]


def test_a_replaced_workers_live_batches_and_turn_ends_are_fenced_together(
        sim_stack: Stack) -> None:
    """A worker's turns write their deltas to chat.live, many turns to a record, and their
    starts and ends to chat.generations, in the same transactions (``workers.output``).
    Once its member has left the group, neither reaches a read_committed reader: the
    batch with a turn's last delta and the turn's end are refused together."""
    suffix = uuid.uuid4().hex[:8]
    source, group, worker = f"fence-live.in.{suffix}", f"fence-live-{suffix}", f"w-{suffix}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(source, 1, {})])
    conversation = uuid.uuid4()
    ids = {"conversation_id": conversation, "request_id": f"chatcmpl-{suffix}"}

    # References no prompt of the suite has: the stack is shared, and a reader of the
    # live stream names a turn by the prompt at its reference (a turn of test_workers
    # once took these deltas for its own).
    ref = 2**40 + 7

    async def scenario() -> str:
        member = await _assigned(sim_stack.bootstrap, group, source,
                                 **{"session.timeout.ms": 6000})
        writer = TransactionalProducer(sim_stack.bootstrap, f"fence-live-{suffix}",
                                       TransactionSettings(timeout_ms=10_000),
                                       lambda: {(source, 0): 0})
        await asyncio.to_thread(writer.start)
        writer.set_group(await member.call(member.group_metadata_sync))
        output = Output(writer, worker, CLEAR)
        key = str(conversation).encode()
        output.start(0, ref, GenerationStarted(**ids, ref=ref, model="m", worker=worker,
                                             reply_seq=1, prompt_tokens=3), key, writer.epoch,
                     None)
        output.delta(0, ref, 0, "before ", (1,), writer.epoch)
        output.delta(1, ref + 2, 0, "another turn ", (2,), writer.epoch)  # another partition
        output.flush(writer.epoch)
        assert await asyncio.to_thread(writer.flush_sync, 30)
        await member.close()  # the member leaves and another takes the partition
        successor = await _assigned(sim_stack.bootstrap, group, source)
        output.delta(0, ref, 1, "after", (3,), writer.epoch)
        finished = GenerationFinished(
            **ids, ref=ref, model="m", reply_seq=1, finish_reason="stop", text="before after",
            usage=Usage(prompt_tokens=3, completion_tokens=2), deltas=2, duration_ms=1)
        ended = output.end(0, ref, finished, key, CLEAR.encode(finished))
        output.flush(writer.epoch)
        try:
            await ended
            outcome = "committed"
        except Fenced:
            outcome = "refused"
        await asyncio.to_thread(writer.close)
        await successor.close()
        return outcome

    assert asyncio.run(scenario()) == "refused"
    mine = f'"worker":"{worker}"'.encode()
    live = [v for _, v, _ in read_records(sim_stack.bootstrap, LIVE) if v and mine in v]
    assert len(live) == 2 and all(b"before" in v or b"another turn" in v for v in live)
    written = [v for _, v, _ in read_records(sim_stack.bootstrap, LIVE, committed=False)
               if v and mine in v]
    assert any(b'"after"' in v for v in written)  # written, then aborted
    durable = [v for _, v, _ in read_records(sim_stack.bootstrap, GENERATIONS)
               if v and ids["request_id"].encode() in v]
    assert len(durable) == 1 and b"GenerationStarted" in durable[0]


def test_a_record_larger_than_its_topic_takes_is_refused_alone_and_at_once(
        sim_stack: Stack) -> None:
    """A record past the size its topic takes is answered ``RecordTooLarge`` alone: at
    once if the producer knows the limit (it never enters a transaction), and, if only
    the broker knows it (a topic set lower than the producer thinks), when the broker
    refuses it, while the records beside it in the transaction are written. It was taken
    for a passing error: its transaction was aborted and sent again, with every prompt
    queued beside it, for as long as the deadline allowed."""
    topic = f"sizes.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(topic, 1, {"max.message.bytes": "100000"})])

    def event(i: int, size: int = 10) -> SessionCreated:
        # Random text: compressed, a batch of it is still past the topic's limit.
        return SessionCreated(conversation_id=uuid.uuid4(), request_id=f"r{i}",
                              **({"padding": secrets.token_urlsafe(size)} if size > 200 else {}))

    async def scenario() -> tuple[list[str], float, float]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"sizes-{uuid.uuid4().hex[:8]}",
                                       TransactionSettings(max_record_bytes=1_000_000,
                                                           interval_ms=50))
        writer.start()
        assert await asyncio.to_thread(writer.ready.wait, 60), "never registered"
        started = time.monotonic()
        with pytest.raises(RecordTooLarge):  # past what the producer takes: never queued
            await writer.send(topic, event(0, 2_000_000))
        known_s = time.monotonic() - started
        started = time.monotonic()
        sent = [writer.send(topic, event(i, 500_000 if i == 5 else 10)) for i in range(1, 11)]
        outcomes = []
        for future in sent:
            try:
                await asyncio.wait_for(future, 30)
                outcomes.append("written")
            except RecordTooLarge:
                outcomes.append("too large")
        broker_s = time.monotonic() - started
        await asyncio.to_thread(writer.close)
        return outcomes, known_s, broker_s

    outcomes, known_s, broker_s = asyncio.run(scenario())
    assert outcomes == ["written"] * 4 + ["too large"] + ["written"] * 5
    assert known_s < 0.1 and broker_s < 5, (known_s, broker_s)
    written = [v.split(b'"request_id":"')[1].split(b'"')[0]
               for _, v, _ in read_records(sim_stack.bootstrap, topic)]
    assert written == [f"r{i}".encode() for i in range(1, 11) if i != 5]


def test_a_fetch_that_stopped_while_caught_up_is_found_once_records_come(
        sim_stack: Stack) -> None:
    """librdkafka's fetch of an assigned partition can stop for good once its brokers
    restart (librdkafka #5153). A stopped fetch no longer updates the cached watermarks a
    worker counts its lag from, so one that stopped while caught up looked idle for good,
    its prompts never run. Here partition 0's fetch is stopped by pausing it, and a record
    comes after: with a cached lag of 0, the watch, asking Kafka on a client of its
    own the end of partitions that have not moved, finds it and restarts its fetch. The
    caught-up partition beside it, where nothing came, is left be."""
    suffix = uuid.uuid4().hex[:8]
    source = f"stall.in.{suffix}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(source, 2, {})])
    producer = Producer({"bootstrap.servers": sim_stack.bootstrap})

    def write(value: bytes, partition: int) -> None:
        producer.produce(source, value, partition=partition)
        assert producer.flush(10) == 0

    async def scenario() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        member = await _assigned(sim_stack.bootstrap, f"stall-{suffix}", source)
        watch = StallWatch(member, LogReader(sim_stack.bootstrap, f"ends-{suffix}", "ends"),
                           stall_s=0.5)
        try:
            for partition in (0, 1):
                write(b"first", partition)
            deadline, read = time.monotonic() + 30, 0
            while read < 2:  # caught up: a position of 1 on each
                assert time.monotonic() < deadline, "the first records never came"
                read += len(await member.poll_batch(10, 0.2))
            await member.call(member._consumer.pause, [TopicPartition(source, 0)])
            write(b"second", 0)  # no fetch will see it
            # The cached lag of a fetch that stopped while caught up. (A fetch in flight
            # at the pause may still bring partition 0's new end: that lag the watch
            # acts on without asking; here, the case where none came.)
            lag = {(source, 0): 0, (source, 1): 0}
            at_once = await watch.check(lag, paused=False)  # where each stands
            deadline = time.monotonic() + 20
            while not (found := await watch.check(lag, paused=False)):
                assert time.monotonic() < deadline, "the stopped fetch was never found"
                await asyncio.sleep(0.1)
            return at_once, found
        finally:
            await watch.close()
            await member.close()

    at_once, found = asyncio.run(scenario())
    assert at_once == [] and found == [(source, 0)]
