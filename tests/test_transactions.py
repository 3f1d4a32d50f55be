"""The worker's writes are fenced by its consumer group (KIP-447), against the real broker:
once a member has left the group, a transaction that shows the broker its old group
metadata is refused, and its records never reach a read_committed reader."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from pipeline.kafka import AsyncConsumer, Fenced, TransactionalProducer, ensure_topics
from pipeline.topics import TopicSpec
from schemas import SessionCreated
from tests.conftest import Stack
from tests.logread import read_records

pytestmark = pytest.mark.integration


def test_a_writer_whose_member_left_the_group_is_refused(sim_stack: Stack) -> None:
    suffix = uuid.uuid4().hex[:8]
    source, sink, group = f"fence.in.{suffix}", f"fence.out.{suffix}", f"fence-{suffix}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(source, 1, {}), TopicSpec(sink, 1, {})])

    async def scenario() -> tuple[list[str], int]:
        fenced_calls = 0

        def on_fenced(_answered: bool) -> None:
            nonlocal fenced_calls
            fenced_calls += 1

        member = AsyncConsumer(sim_stack.bootstrap, group, **{"session.timeout.ms": 6000})
        member.subscribe([source])
        deadline = time.monotonic() + 30
        while not await member.call(member.assignment_sync):
            assert time.monotonic() < deadline, "never assigned"
            await member.poll_batch(1, 0.2)
        writer = TransactionalProducer(
            sim_stack.bootstrap, f"fence-writer-{suffix}", lambda: {(source, 0): 0},
            on_committed=lambda _: None, on_fenced=on_fenced, timeout_ms=10_000)
        await asyncio.to_thread(writer.start)
        writer.set_group(await member.call(member.group_metadata_sync))

        def event(title: str) -> SessionCreated:
            return SessionCreated(conversation_id=uuid.uuid4(), request_id=title, title=title)

        await writer.send(sink, event("while a member"), writer.epoch)
        # The member leaves and another takes the partition: the writer is now a zombie.
        await member.close()
        successor = AsyncConsumer(sim_stack.bootstrap, group)
        successor.subscribe([source])
        deadline = time.monotonic() + 30
        while not await successor.call(successor.assignment_sync):
            assert time.monotonic() < deadline, "the successor was never assigned"
            await successor.poll_batch(1, 0.2)
        outcomes = []
        for title in ("after leaving", "and again"):
            try:
                await writer.send(sink, event(title), writer.epoch)
                outcomes.append("committed")
            except Fenced:
                outcomes.append("refused")
        await asyncio.to_thread(writer.close)
        await successor.close()
        return outcomes, fenced_calls

    outcomes, fenced_calls = asyncio.run(scenario())
    assert outcomes == ["refused", "refused"] and fenced_calls >= 1
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
                                       interval_ms=200)
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
                                       interval_ms=500, gathers=gathers)
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


def test_a_sender_waits_for_room_while_the_log_takes_records_slower_than_they_come(
        sim_stack: Stack) -> None:
    """A worker's turns stop queueing tokens past ``max_queued`` records: a flood of
    deltas grew a worker past 10 GB while its transactions fell behind. ``room()`` waits
    until a transaction has taken the queue, and every record is written, in order."""
    sink = f"room.{uuid.uuid4().hex[:8]}"
    ensure_topics(sim_stack.bootstrap, [TopicSpec(sink, 1, {})])

    async def scenario() -> tuple[bool, bool]:
        writer = TransactionalProducer(sim_stack.bootstrap, f"room-{uuid.uuid4().hex[:8]}",
                                       max_queued=50)
        for i in range(50):  # not started yet: nothing takes them
            writer.send_nowait(sink, SessionCreated(conversation_id=uuid.uuid4(),
                                                    request_id=f"r{i}", title=str(i)))
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
    assert all(f'"title":"{i}"'.encode() in value for i, value in enumerate(values))


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
                                       interval_ms=1000)
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
