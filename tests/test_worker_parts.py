"""The worker's parts without a broker: the offset watermark (``workers.offsets``),
recovery's fold (``workers.recovery``), takeover's progress (``workers.takeover``), the
SIMULATED engine's pace, the engine's scheduling priority (``workers.host``), and what one
transaction of the worker's output holds (``workers.output``)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.sealing import DroppingWriter
from pipeline.codec import CLEAR, Position
from pipeline.kafka import Record
from pipeline.topics import LIVE
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    SamplingParams,
    TokenDelta,
    Usage,
)
from schemas.live import Delta, entries
from workers.engine import EngineRequest, outputs
from workers.host import AUTOGROUP_SWITCH, lower_session_priority
from workers.offsets import OffsetTracker
from workers.recovery import LogFolder, Recovered, fold, fold_values
from workers.sim_engine import SimEngine, sim_token_text
from workers.takeover import reported
from workers.turn import resumed_after_engine_death

CONV = uuid.uuid4()


def test_watermark_commits_below_the_oldest_in_flight_offset() -> None:
    t = OffsetTracker()
    tp = ("chat.prompts", 0)
    for offset in (5, 6, 7):
        t.taken(tp, offset)
    t.done(tp, 6)
    assert t.committable() == {tp: 5}  # 5 still in flight: nothing past it is safe
    t.mark_committed({tp: 5})
    assert t.committable() == {}
    t.done(tp, 5)
    assert t.committable() == {tp: 7}
    t.done(tp, 7)
    assert t.committable() == {tp: 8}
    t.forget([tp])
    assert t.committable() == {}


def test_recovery_from_raw_records_equals_the_fold_of_every_decoded_event() -> None:
    """The takeover scan decodes only terminal events and unfinished turns' records; it
    must find what decoding everything finds, whatever text the deltas carry."""
    tricky = 'x", "request_id":"done", "type":"GenerationFinished" \\" '

    def turn(rid: str, deltas: int, end: str | None, attempt: int = 0) -> list[object]:
        ids = {"conversation_id": CONV, "request_id": rid}
        events: list[object] = [GenerationStarted(**ids, model="m", worker="w",
                                                  attempt=attempt, reply_seq=1,
                                                  prompt_tokens=3)]
        events += [TokenDelta(**ids, attempt=attempt, seq=i, text=f"{tricky}{i}")
                   for i in range(deltas)]
        if end == "finished":
            events.append(GenerationFinished(
                **ids, model="m", reply_seq=1, finish_reason="stop", text="", deltas=deltas,
                usage=Usage(prompt_tokens=3, completion_tokens=deltas), duration_ms=1))
        elif end == "failed":
            events.append(GenerationFailed(**ids, code="engine_dead", message="x"))
        return events

    events = [*turn("done", 5, "finished"), *turn("open", 3, None),
              *turn("failed", 2, "failed"), *turn("open", 2, None, attempt=1),
              *turn("chatcmpl-\\\"odd", 2, None)]
    values: list[bytes | None] = [CLEAR.encode(e) for e in events]  # type: ignore[arg-type]
    values += [None, b"not json", b'{"request_id":"open","type":"GenerationFinished"}']

    expected = {rid: Recovered(ended=True) if rec.ended else rec
                for rid, rec in fold(events).items()}  # type: ignore[arg-type]
    found = fold_values(values)
    assert found == expected
    assert found["open"].attempt == 1 and [d.seq for d in found["open"].emitted()] == [0, 1, 2]
    assert found["done"].ended and found["failed"].ended and not found["open"].ended


def test_a_takeover_holds_only_the_records_of_turns_not_seen_to_end() -> None:
    """A worker taking over folds a window of ``chat.generations`` as it reads it: the
    records of a turn are dropped, undecoded, once its end is read. Kept whole, the
    window of a busy log took a worker past 10 GB before it served anything."""
    folder = LogFolder()
    for t in range(200):
        ids = {"conversation_id": uuid.uuid4(), "request_id": f"turn-{t}"}
        folder.add(CLEAR.encode(GenerationStarted(**ids, model="m", worker="w", reply_seq=1,
                                            prompt_tokens=3)))
        for i in range(50):
            folder.add(CLEAR.encode(TokenDelta(**ids, seq=i, text=f"t{i} ")))
        if t < 199:
            folder.add(CLEAR.encode(GenerationFinished(
                **ids, model="m", reply_seq=1, finish_reason="stop", text="", deltas=50,
                usage=Usage(prompt_tokens=3, completion_tokens=50), duration_ms=1)))
        assert folder.held == (51 if t == 199 else 0)
    found = folder.result()
    assert len(found) == 200 and sum(r.ended for r in found.values()) == 199
    assert [d.seq for d in found["turn-199"].emitted()] == list(range(50))


def test_a_long_takeover_read_logs_how_far_it_has_come(caplog: pytest.LogCaptureFixture) -> None:
    since = int(time.time() * 1000) - 100_000
    records = [Record(Position("chat.generations", 0, i), None, b"{}", since + i * 25_000)
               for i in range(4)]
    with caplog.at_level(logging.INFO, logger="workers.takeover"):
        assert list(reported(records, since, "reading chat.generations", every_s=0)) == records
    assert [r.getMessage() for r in caplog.records] == [
        f"taking over: reading chat.generations: {i + 1} records in 0 s, {25 * i}% of the way "
        "to now" for i in range(4)]


def test_simulated_engine_keeps_its_pace_when_the_reader_runs_late() -> None:
    """A GPU's steps do not wait for the reader: tokens due while the reader's event
    loop was blocked arrive at once, and the sequence ends on time."""
    engine = SimEngine(ttft_ms=0, tokens_per_s=50)  # a token every 20 ms
    request = EngineRequest("r1", (ChatMessage(role="user", content="hi"),),
                            SamplingParams(max_tokens=10))

    async def read() -> tuple[list[str], float]:
        texts, start = [], time.monotonic()
        async for out in outputs(engine, request):
            if not texts:  # the reader's loop is busy for 150 ms: 7 tokens fall due
                busy_until = time.monotonic() + 0.15
                while time.monotonic() < busy_until:
                    pass
            texts.append(out.text)
        return texts, time.monotonic() - start

    texts, elapsed = asyncio.run(read())
    assert texts == [sim_token_text(i) for i in range(10)]
    # Due at 9 x 20 ms = 180 ms; a simulator that slept a step after each token
    # would take the block on top (330 ms).
    assert elapsed < 0.26


def test_simulated_engine_steps_every_sequence_together_as_a_gpu_batch_does() -> None:
    """Sequences started at different moments get their tokens at the same steps, so
    the reader wakes once per step, not once per token."""
    engine = SimEngine(ttft_ms=5, tokens_per_s=50)  # a step every 20 ms

    async def times(request_id: str, after_s: float) -> list[float]:
        await asyncio.sleep(after_s)
        request = EngineRequest(request_id, (ChatMessage(role="user", content="hi"),),
                                SamplingParams(max_tokens=4))
        return [asyncio.get_running_loop().time() async for _ in outputs(engine, request)]

    async def both() -> list[list[float]]:
        return list(await asyncio.gather(times("r1", 0.0), times("r2", 0.007)))

    first, second = asyncio.run(both())
    # A clock per sequence would give r2 each token 7 ms after r1's; one clock gives
    # them together (r2's first token may come a step later than r1's).
    together = [t for t in second if any(abs(t - u) < 0.002 for u in first)]
    assert len(together) >= 3, (first, second)


def test_session_priority_changes_only_a_session_of_its_own() -> None:
    own = subprocess.Popen(["sleep", "30"], start_new_session=True)
    shared = subprocess.Popen(["sleep", "30"])  # in this session: left alone
    try:
        autogroup = AUTOGROUP_SWITCH.exists() and AUTOGROUP_SWITCH.read_text().strip() == "1"
        before = Path(f"/proc/{shared.pid}/autogroup").read_text() if autogroup else ""
        assert lower_session_priority(own.pid, 7) is autogroup
        assert lower_session_priority(shared.pid, 7) is False
        if autogroup:
            assert Path(f"/proc/{own.pid}/autogroup").read_text().split()[-1] == "7"
            assert Path(f"/proc/{shared.pid}/autogroup").read_text() == before
    finally:
        own.kill()
        shared.kill()
        own.wait()
        shared.wait()


class _Recording(DroppingWriter):
    """A writer that keeps the topics of what each gather queued (a transaction's worth)
    and, while ``busy``, has a transaction being made (``begins_in`` None) until
    ``free()``; ``spacing_s``: what is left of the spacing then."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: list[list[str]] = [[]]
        self.live: list[bytes] = []  # the live records' values, in order
        self.busy, self.spacing_s = False, 0.0
        self.waiting: list[Callable[[], None]] = []

    def gathered(self) -> None:
        self.gathers.append([])

    def begins_in(self) -> float | None:
        return None if self.busy else self.spacing_s

    def when_free(self, callback: Callable[[], None]) -> bool:
        if self.busy:
            self.waiting.append(callback)
        return self.busy

    def free(self) -> None:
        self.busy = False
        for callback in self.waiting:
            asyncio.get_running_loop().call_soon(callback)
        self.waiting.clear()

    def send_together(self, records, epoch=0):  # type: ignore[no-untyped-def]
        self.gathers[-1] += [r.topic for r in records]
        self.live += [r.value for r in records if r.topic == LIVE]
        done = []
        for r in records:
            future = asyncio.get_running_loop().create_future()
            future.set_result(Position(r.topic, r.partition or 0, 0))
            done.append(future)
        return done


def test_a_turns_text_in_one_live_record_is_one_delta_and_a_stopped_turn_writes_none_held(
        ) -> None:
    """The steps a record spans (held while a transaction is being made) give each turn
    one delta in it, seq gap-free across records; a turn stopped meanwhile (preempted,
    its partition moved) writes none of what it held, and what the turn emitted is what
    its end says."""
    from bench.hotpath import _takers
    from workers.output import GATHER_PASSES

    takers, output, _ = _takers(2, 1)
    writer = _Recording()
    output.writer = takers[0].runner.writer = writer  # type: ignore[assignment]

    async def scenario() -> None:
        writer.busy = True
        for step in range(3):
            for taker in takers:
                taker.take(f"t{step} ", (step,), 5, None)
            await asyncio.sleep(0)
        takers[1].drop()  # stopped: its run raised CancelledError
        writer.free()
        for _ in range(GATHER_PASSES + 1):
            await asyncio.sleep(0)
        takers[0].take("t3 ", (3,), 5, "length")
        final = await takers[0].runner.end(takers[0].turn, takers[0].finished())
        assert (final.text, final.deltas) == ("t0 t1 t2 t3 ", 2)

    asyncio.run(scenario())
    records = [output.codec.decode_live(value) for value in writer.live]
    deltas = [[(ref, d.seq, d.text, d.token_ids) for _, ref, d in entries(batch)
               if isinstance(d, Delta)] for batch in records]
    first = takers[0].ref
    assert deltas == [[(first, 0, "t0 t1 t2 ", (0, 1, 2))], [(first, 1, "t3 ", (3,))]]
    assert takers[1].turn.progress.parts == []  # a next attempt generates it again


def test_the_turns_a_step_ends_end_in_the_transaction_of_its_deltas() -> None:
    """An engine step hands its outputs, then resolves the runs it ended, as both
    engines do; the turns' tasks write their ends in the loop's next pass. Those ends
    are gathered with the step's deltas: one transaction, one live record per
    partition, not the deltas' transaction and then one of the ends alone."""
    from bench.hotpath import _takers
    from pipeline.topics import GENERATIONS, LIVE
    from workers.output import GATHER_PASSES

    takers, output, _ = _takers(4, 2)
    writer = _Recording()
    output.writer = takers[0].runner.writer = writer  # type: ignore[assignment]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        for taker in takers:
            taker.take("first ", (999,), 5, None)
        for _ in range(GATHER_PASSES):
            await asyncio.sleep(0)
        ran = [loop.create_future() for _ in takers]

        async def turn(taker, run):  # type: ignore[no-untyped-def]
            await run  # its run on the engine
            return await taker.runner.end(taker.turn, taker.finished())

        tasks = [asyncio.create_task(turn(t, r)) for t, r in zip(takers, ran, strict=True)]
        await asyncio.sleep(0)
        for taker, run in zip(takers, ran, strict=True):  # the step: every turn's last
            taker.take("last ", (1000,), 5, "length")
            run.set_result(None)
        ends = await asyncio.gather(*tasks)
        assert [e.text for e in ends] == ["first last "] * 4

    asyncio.run(scenario())
    first, step, nothing = writer.gathers
    assert sorted(first) == [GENERATIONS] * 4 + [LIVE] * 2  # the starts and first deltas
    assert sorted(step) == [GENERATIONS] * 4 + [LIVE] * 2  # the last deltas and the ends
    assert nothing == []


def test_steps_a_transaction_could_not_take_yet_share_one_record_per_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a transaction is being made, and until the spacing since it began has
    passed, a gather holds the open batches: the steps meanwhile add to the same records
    (one live record per partition, one box per turn, for all of them), queued together
    once the writer can take them. A writer that never says it is free is not waited
    for past ``HOLD_MAX_S``."""
    from bench.hotpath import _takers
    from pipeline.topics import LIVE
    from workers import output as module

    monkeypatch.setattr(module, "HOLD_MAX_S", 0.2)
    takers, output, _ = _takers(4, 2)
    writer = _Recording()
    output.writer = takers[0].runner.writer = writer  # type: ignore[assignment]

    async def steps(n: int, first: int) -> None:
        for s in range(first, first + n):
            for taker in takers:
                taker.take(f"t{s} ", (s,), 5, None)
            for _ in range(module.GATHER_PASSES + 1):
                await asyncio.sleep(0)

    async def scenario() -> None:
        writer.busy = True
        await steps(3, 0)
        assert writer.gathers == [[]] and output.records == 0  # held: nothing queued
        writer.free()
        await asyncio.sleep(0)
        assert [sorted(g) for g in writer.gathers[:-1]] == [
            ["chat.generations"] * 4 + [LIVE] * 2]  # the starts, and each partition's record
        assert output.records == 2  # three steps, one record per partition
        writer.spacing_s = 0.05  # the next may begin in 50 ms: held as long
        await steps(2, 3)
        assert output.records == 2
        await asyncio.sleep(0.08)
        assert output.records == 4 and writer.gathers[-2] == [LIVE] * 2
        writer.spacing_s, writer.busy = 0.0, True  # a writer that never says
        await steps(1, 5)
        await asyncio.sleep(0.1)
        assert output.records == 4
        await asyncio.sleep(0.2)
        assert output.records == 6

    asyncio.run(scenario())
    texts = ["".join(t.turn.progress.parts) for t in takers]
    assert texts == ["t0 t1 t2 t3 t4 t5 "] * 4  # every step's delta kept, in order


def test_offsets_alone_get_a_transaction_only_once_the_log_is_quiet() -> None:
    """The worker asks every 0.2 s that offsets that moved be committed
    (``COMMIT_INTERVAL_S``). While its steps' transactions run, each commits them as
    they then are, so no transaction of their own begins; once none has begun for that
    long, one does (an offsets-only transaction: an empty batch)."""
    import threading

    from pipeline.kafka.outbox import Outbox, Pacing, RecordLimits
    from workers.worker import COMMIT_INTERVAL_S

    outbox = Outbox(RecordLimits(2**20), Pacing(), 100)
    taken: list[list[object]] = []
    loop = threading.Thread(target=lambda: taken.append(outbox.next_batch(lambda: True)))
    loop.start()
    try:
        outbox.began(time.monotonic())  # a step's transaction began just now
        outbox.want_commit(COMMIT_INTERVAL_S)
        loop.join(0.1)
        assert loop.is_alive() and taken == []  # it carries the offsets
        time.sleep(COMMIT_INTERVAL_S)
        outbox.want_commit(COMMIT_INTERVAL_S)  # quiet since: one of their own
        loop.join(5)
        assert taken == [[]]
    finally:
        outbox.stop()
        loop.join(5)


def test_a_turn_the_engine_died_under_is_resumed_only_if_it_streamed_early_in_its_life(
        ) -> None:
    """A turn with no output in this attempt may have killed the engine (its prefill):
    it fails, so it cannot kill the next one. One that streamed is resumed, on its first
    two attempts: a prompt that kills engines later on kills at most three."""
    assert resumed_after_engine_death(streamed=True, attempt=0)
    assert resumed_after_engine_death(streamed=True, attempt=1)
    assert not resumed_after_engine_death(streamed=True, attempt=2)
    assert not resumed_after_engine_death(streamed=False, attempt=0)
    # The engine had died before the turn reached it: the turn did not kill it.
    assert resumed_after_engine_death(streamed=False, attempt=0, before=True)
    assert resumed_after_engine_death(streamed=True, attempt=5, before=True)


def test_a_takeover_asks_nothing_more_of_a_consumer_that_closes() -> None:
    """A worker asked to stop while it joined its group hung: the consumer's close served
    the assignment callback, whose takeover retried forever on a client being destroyed
    (``_DESTROY``), and the process never exited (10 minutes, by hand). A takeover now
    gives up once its consumer closes, and one the close itself calls asks nothing."""
    from types import SimpleNamespace
    from typing import Any, cast

    from confluent_kafka import KafkaError

    from pipeline.kafka import KafkaException
    from workers.takeover import Rebalances, retrying

    consumer = SimpleNamespace(closing=False)
    asked: list[float] = []

    def take() -> dict[tuple[str, int], int]:
        asked.append(time.monotonic())
        consumer.closing = True  # the worker's stop closes the consumer meanwhile
        raise KafkaException(KafkaError(KafkaError._DESTROY))

    assert retrying(take, lambda: consumer.closing) is None
    assert len(asked) == 1
    rebalances = Rebalances(cast(Any, None), "unused:9092", cast(Any, consumer),
                            cast(Any, None), CLEAR, "m", 60.0, 60_000)
    assert rebalances.on_assign([("chat.prompts", 0)]) is None  # nothing asked: no owner
