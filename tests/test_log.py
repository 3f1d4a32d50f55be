"""The log at production scale, against the real broker and PostgreSQL (SIMULATED engine):

* a log written by the code before the live stream (prompts repeating their session,
  each token a ``TokenDelta`` event) is still read: projected, replayed, streamed,
  resumed, audited, continued, and a turn of it in flight is taken over;
* a session's prompts do not grow with it: a session past a million characters of
  history is served, each prompt the size of its own message;
* a size that can never fit fails alone, fast and clearly: a prompt past what its topic
  takes is 413 in under a second, while requests beside it are served;
* a reader whose fetch queue fills reads on at once (``QUEUE_REFILL``): a look-up or a
  range read through more than its queue holds never waits out librdkafka's queue
  backoff, a second each time;
* a gateway's tail whose fetch of a partition stops reads it again from where it
  stopped, and the turns followed there go on;
* a client's stream whose live items come with a gap is filled from the log, once per
  gap: a gap the log has too is sent as it is, and the stream still ends.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import Producer, TopicPartition
from prometheus_client import CollectorRegistry
from psycopg_pool import AsyncConnectionPool

from gateway.follow import Follow, Following
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.tail import STALL_S, GenerationTail
from infra.process import free_port
from pipeline.codec import Codec, Position, conversation_key
from pipeline.kafka import EventProducer, ensure_topics
from pipeline.kafka.lookup import PositionReader
from pipeline.kafka.plain import PlainWriter
from pipeline.kafka.reader import LogReader
from pipeline.partitioning import partition_for
from pipeline.topics import GENERATIONS, LIVE, PROMPTS, TopicSpec
from schemas import PromptSubmitted
from schemas.live import Delta, End, Failure, Start, write_batch
from tests.conftest import (
    PARTITIONS,
    Pipeline,
    Stack,
    idempotent_conversation,
    new_database,
    start_service,
    wait_healthy,
)
from tests.logread import model_input, read_events, read_live, read_records
from tests.replaying import snapshot
from tests.sse import resume_chat, scrape, stream_chat
from workers.sim_engine import SIM_VOCAB_BASE, sim_token_text

pytestmark = pytest.mark.integration

RATE = 200  # simulated tokens/s per sequence
BIG_BODY = 16 * 2**20  # what this module's gateway takes (the default is 1 MB)


def expected(tokens: int, start: int = 0) -> str:
    return "".join(sim_token_text(i) for i in range(start, tokens))


# -- the code before the live stream, as it wrote its records -------------------------
@dataclass
class OldTurn:
    """A turn as the code before the live stream wrote it, by hand (the shapes of its
    events at that version: prompts v3 repeating the session, starts and ends v1, one
    ``TokenDelta`` record per delta)."""

    conversation: uuid.UUID
    request_id: str
    messages: list[tuple[str, str]]  # the whole session, this turn's message last
    history_len: int
    history_end: int | None
    deltas: list[str]
    ended: bool = True

    def prompt(self) -> dict[str, Any]:
        return {"v": 3, **self._ids("PromptSubmitted"), "history_end": self.history_end,
                "model": "sim", "alias": None, "rollout": None,
                "messages": [{"role": r, "content": c} for r, c in self.messages],
                "history_len": self.history_len,
                "sampling": {"temperature": None, "top_p": None, "top_k": None,
                             "max_tokens": 10, "stop": [], "seed": None, "n": 1,
                             "ignore_eos": True},
                "idempotency_key": None, "background": False}

    def generations(self) -> list[dict[str, Any]]:
        reply_seq = len(self.messages)
        out = [{"v": 1, **self._ids("GenerationStarted"), "model": "sim", "worker": "old-1",
                "attempt": 0, "reply_seq": reply_seq, "prompt_tokens": 5}]
        out += [{"v": 1, **self._ids("TokenDelta"), "attempt": 0, "seq": i, "text": text,
                 "token_ids": [SIM_VOCAB_BASE + i]} for i, text in enumerate(self.deltas)]
        if self.ended:
            out.append({"v": 1, **self._ids("GenerationFinished"), "model": "sim",
                        "attempt": 0, "reply_seq": reply_seq, "finish_reason": "length",
                        "text": "".join(self.deltas),
                        "usage": {"prompt_tokens": 5, "completion_tokens": len(self.deltas)},
                        "deltas": len(self.deltas), "ttft_ms": 1.0, "duration_ms": 2.0})
        return out

    def _ids(self, kind: str) -> dict[str, Any]:
        return {"event_id": str(uuid.uuid4()), "conversation_id": str(self.conversation),
                "request_id": self.request_id, "tenant": "default", "type": kind,
                "occurred_at": datetime.now(UTC).isoformat().replace("+00:00", "Z")}


def write_old(bootstrap: str, topic: str, events: list[dict[str, Any]]) -> list[Position]:
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random",
                         "enable.idempotence": True})
    positions: list[Position] = []

    def done(err: object, msg: Any) -> None:
        assert err is None, err
        positions.append(Position(msg.topic(), msg.partition(), msg.offset()))

    for event in events:
        producer.produce(topic, key=event["conversation_id"].encode(),
                         value=json.dumps(event).encode(), on_delivery=done)
        producer.flush(10)
    return positions


def completion(conversation: uuid.UUID) -> str:
    return f"chatcmpl-{conversation.hex}{uuid.uuid4().hex[:16]}"


@dataclass
class Logged(Pipeline):
    old: list[OldTurn] | None = None  # the finished session of the code before
    in_flight: OldTurn | None = None  # a turn of it that worker left half written


@pytest.fixture(scope="module")
def logged(sim_stack: Stack) -> Iterator[Logged]:
    database_url = new_database(sim_stack.database_url, "logscale")
    stack = Stack(sim_stack.bootstrap, database_url, sim_stack.logs)
    # Written before any service of this module starts: a worker that starts takes the
    # half-written turn over, as one taking over from a worker of the code before does.
    conversation = uuid.uuid4()
    first = OldTurn(conversation, completion(conversation), [("user", "old question")], 0,
                    None, [sim_token_text(i) for i in range(3)])
    write_old(stack.bootstrap, PROMPTS, [first.prompt()])
    write_old(stack.bootstrap, GENERATIONS, first.generations())
    end = max(p.offset for p in read_positions(stack, PROMPTS, conversation)) + 1
    second = OldTurn(conversation, completion(conversation),
                     [("user", "old question"), ("assistant", expected(3)),
                      ("user", "old follow-up")], 2, end, [sim_token_text(i) for i in range(4)])
    write_old(stack.bootstrap, PROMPTS, [second.prompt()])
    write_old(stack.bootstrap, GENERATIONS, second.generations())
    other = uuid.uuid4()
    half = OldTurn(other, completion(other), [("user", "cut short")], 0, None,
                   [sim_token_text(i) for i in range(5)], ended=False)
    write_old(stack.bootstrap, PROMPTS, [half.prompt()])
    write_old(stack.bootstrap, GENERATIONS, half.generations())

    port, worker_metrics = free_port(), free_port()
    services = {
        "projector": start_service(stack, "log-projector", "projector"),
        "worker": start_service(stack, "log-worker", "worker", "--engine", "sim",
                                "--max-num-seqs", "64", "--metrics-port", str(worker_metrics),
                                WORKER_SIM_TOKENS_PER_S=str(RATE),
                                WORKER_MAX_MODEL_LEN="2000000"),
        "gateway": start_service(stack, "log-gateway", "gateway", "--port", str(port),
                                 GATEWAY_MODELS="sim", GATEWAY_MAX_BODY_BYTES=str(BIG_BODY)),
    }
    p = Logged(stack, f"http://127.0.0.1:{port}", services,
               worker_metrics=f"http://127.0.0.1:{worker_metrics}/metrics",
               old=[first, second], in_flight=half)
    try:
        wait_healthy(p.url, list(services.values()), timeout=60)
        yield p
    finally:
        for s in services.values():
            s.stop()


def read_positions(stack: Stack, topic: str, conversation: uuid.UUID) -> list[Position]:
    return [pos for pos, e in read_events(stack.bootstrap, topic)
            if e.conversation_id == conversation]


def stored(database_url: str, conversation: uuid.UUID) -> list[tuple[int, str, str]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute("SELECT seq, role, content FROM messages WHERE conversation_id"
                            " = %s ORDER BY seq", (conversation,)).fetchall()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# -- a log of the code before ---------------------------------------------------------
def test_a_log_written_before_the_live_stream_is_stored_replayed_and_streamed(
        logged: Logged) -> None:
    assert logged.old is not None
    first, second = logged.old
    conversation = first.conversation
    logged.wait_projected()
    assert stored(logged.stack.database_url, conversation) == [
        (0, "user", "old question"), (1, "assistant", expected(3)),
        (2, "user", "old follow-up"), (3, "assistant", expected(4))]
    # A replay into an empty schema gives the same rows as the live projector did (this
    # conversation's: other modules' turns may still be ending as the two are read).
    from tests.replaying import replay_into_new_schema

    schema = replay_into_new_schema(logged.stack)
    live, rebuilt = (snapshot(logged.stack.database_url, s, only=frozenset({conversation}))
                     for s in ("public", schema))
    for table in ("conversations", "messages", "generations"):
        assert live[table] == rebuilt[table], table
    # Its turns stream from their TokenDelta events, with positions in chat.generations,
    # and resume from any of them.
    whole = resume_chat(logged.url, second.request_id)
    assert whole.done and whole.text == expected(4) and whole.finish_reason == "length"
    assert all(len(i.split("-")) == 2 for i in whole.ids), whole.ids
    rest = resume_chat(logged.url, second.request_id, whole.ids[2])
    assert rest.done and whole.text.startswith(expected(2)) and rest.ids == whole.ids[3:]
    status = httpx.get(f"{logged.url}/v1/chat/completions/{first.request_id}", timeout=30)
    assert status.json()["choices"][0]["message"]["content"] == expected(3)


def test_a_session_of_the_code_before_goes_on_with_its_history(logged: Logged) -> None:
    """The next turn of an old session names its previous turn, whose prompt repeats the
    session inline (v3): the worker rebuilds the model's input from it, and it is what
    the gateway read."""
    assert logged.old is not None
    conversation = logged.old[0].conversation
    logged.wait_projected()
    before = scrape(logged.worker_metrics).get("worker_history_mismatches_total", 0)
    r = httpx.post(f"{logged.url}/v1/sessions/{conversation}/messages", timeout=60,
                   json={"content": "new question", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]
    given = model_input(logged.stack.bootstrap, request_id)
    assert given is not None and [(m.role, m.content) for m in given] == [
        ("user", "old question"), ("assistant", expected(3)), ("user", "old follow-up"),
        ("assistant", expected(4)), ("user", "new question")]
    prompt = next(e for _, e in read_events(logged.stack.bootstrap, PROMPTS)
                  if e.request_id == request_id)
    assert isinstance(prompt, PromptSubmitted) and prompt.previous is not None
    assert scrape(logged.worker_metrics).get("worker_history_mismatches_total", 0) == before


def test_a_turn_an_old_worker_left_half_written_is_taken_over_whole(logged: Logged) -> None:
    """The code before wrote five deltas of the turn to chat.generations and died; the
    worker that took the partition over goes on at seq 5 (attempt 1), and first writes
    the five to the live stream, so a client reading either has the whole turn."""
    half = logged.in_flight
    assert half is not None
    wait_until(lambda: httpx.get(f"{logged.url}/v1/chat/completions/{half.request_id}",
                                 timeout=30).json().get("status") == "finished", 60,
               "the half-written turn to end")
    streamed = resume_chat(logged.url, half.request_id)
    assert streamed.done and streamed.text == expected(10), streamed
    live = [i for i in read_live(logged.stack.bootstrap) if i.request_id == half.request_id]
    deltas = [i.item for i in live if isinstance(i.item, Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))  # the five again, then on
    assert [d.text for d in deltas[:5]] == [sim_token_text(i) for i in range(5)]
    assert "".join(d.text for d in deltas) == expected(10)
    assert isinstance(live[0].item, Start) and live[0].item.attempt == 1


# -- sessions that grow --------------------------------------------------------------
def test_a_session_past_a_million_characters_is_served_and_its_prompts_do_not_grow(
        logged: Logged) -> None:
    """25 turns of 40 KB messages: the code before repeated the session in every prompt,
    which passed the topic's 1 MB limit at turn 25 and was refused from then on (503,
    holding up every prompt queued beside it)."""
    created = httpx.post(f"{logged.url}/v1/sessions", json={"title": "long"}, timeout=30)
    session = created.json()["id"]
    message = ("forty kilobytes of words " * 1700)[:40_000]
    for i in range(25):
        r = httpx.post(f"{logged.url}/v1/sessions/{session}/messages", timeout=120,
                       json={"content": f"{i} {message}", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, (i, r.text)
    history = httpx.get(f"{logged.url}/v1/sessions/{session}/messages", timeout=60).json()
    assert len(history["data"]) == 50
    assert sum(len(m["content"]) for m in history["data"]) > 1_000_000
    sizes = [len(value or b"") for _, value, _ in read_records(logged.stack.bootstrap, PROMPTS)
             if value and session.encode() in value]
    assert len(sizes) == 25 and max(sizes) < 45_000, sizes  # each its own message only
    # The last turn's model input is the whole session, rebuilt from the log.
    last = history["data"][-1]["request_id"]
    given = model_input(logged.stack.bootstrap, last)
    assert given is not None and len(given) == 49


# -- sizes fail alone ------------------------------------------------------------------
def test_a_prompt_past_what_the_log_takes_is_refused_alone_and_at_once(logged: Logged) -> None:
    """A request whose prompt is larger than chat.prompts takes (8 MiB by default; this
    gateway takes bodies of 16 MB) gets 413 naming the limit in under a second, and the
    requests sent beside it are served, each in under 2 s. The code before took the
    refusal for a passing error and sent the transaction again, with every prompt queued
    beside it: they were all refused with 503 after 10 s."""
    # Text that does not compress (content of up to a MiB is deflated before it is
    # sealed): 9 MiB of base64 is a record of more than 8 MiB however it is written.
    noise = base64.b64encode(random.Random(7).randbytes(9 * 2**20 * 3 // 4)).decode()
    huge = {"model": "sim", "max_tokens": 2, "messages": [
        {"role": "user", "content": noise}]}
    small = {"model": "sim", "max_tokens": 2, "ignore_eos": True,
             "messages": [{"role": "user", "content": "beside it"}]}

    def timed(body: dict[str, Any]) -> tuple[int, float, dict[str, Any]]:
        started = time.monotonic()
        r = httpx.post(f"{logged.url}/v1/chat/completions", json=body, timeout=60)
        return r.status_code, time.monotonic() - started, r.json()

    with ThreadPoolExecutor(11) as pool:
        big = pool.submit(timed, huge)
        beside = [pool.submit(timed, small) for _ in range(10)]
        status, seconds, body = big.result()
        others = [f.result() for f in beside]
    assert status == 413 and seconds < 1.0, (status, seconds, body)
    assert body["error"]["code"] == "prompt_too_large"
    assert "8,388,608" in body["error"]["message"]
    assert all(s == 200 and t < 2.0 for s, t, _ in others), [(s, t) for s, t, _ in others]
    assert all(b["choices"][0]["message"]["content"] == expected(2) for _, _, b in others)


def test_live_records_hold_many_turns_and_the_durable_record_no_delta(logged: Logged) -> None:
    """16 turns at once in one partition's conversations share live records (one per
    partition per engine step), and the durable record holds only their starts and ends.
    (100 tokens each at 200 a second: long enough for their lives to overlap.)"""
    conversations = []
    while len(conversations) < 16:
        key = uuid.uuid4().hex
        conversation = idempotent_conversation(key)
        if partition_for(conversation_key(conversation), PARTITIONS) == 0:
            conversations.append(key)
    with ThreadPoolExecutor(16) as pool:
        turns = list(pool.map(lambda key: stream_chat(
            logged.url, {"model": "sim", "max_tokens": 100, "ignore_eos": True,
                         "messages": [{"role": "user", "content": key}]},
            headers={"Idempotency-Key": key}), conversations))
    assert all(t.done and t.text == expected(100) for t in turns)
    ours = {t.request_id for t in turns}
    live = [i for i in read_live(logged.stack.bootstrap) if i.request_id in ours]
    records = {i.position for i in live}
    assert {p.topic for p in records} == {LIVE}
    assert len(records) < len(live) / 4, (len(records), len(live))  # many turns a record
    durable = [e for _, e in read_events(logged.stack.bootstrap, GENERATIONS)
               if e.request_id in ours]
    assert sorted(e.type for e in durable) == ["GenerationFinished"] * 16 + \
        ["GenerationStarted"] * 16


def test_a_reader_whose_queue_fills_reads_on_at_once(stack: Stack) -> None:
    """2 MB in one partition, read through by a key look-up (20 records spread over it,
    with its 256 kB queue) and by a range read with a 64 kB queue: each queue fills many
    times over. With librdkafka's default queue backoff each took a second or more
    (1.015 s, and 2.1-2.5 s, measured every time); now each is far under that. The
    fastest of three tries is held to it: the stall came every time, while a busy host
    (a CI run) may slow one try by as much."""
    topic = f"refill-{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.bootstrap, [TopicSpec(topic, 1, {})])
    producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 5})
    for _ in range(4000):
        producer.produce(topic, b"y" * 500, partition=0)
    assert producer.flush(30) == 0
    looked_up, ranged = [], []
    keys = PositionReader(stack.bootstrap, topic, f"{topic}-keys")
    log = LogReader(stack.bootstrap, f"{topic}-range", "test",
                    **{"queued.max.messages.kbytes": 64})
    try:
        for first in range(3):
            started = time.monotonic()
            found = keys.read([(0, o) for o in range(first, 4000, 200)])
            looked_up.append(time.monotonic() - started)
            assert len(found.found) == 20 and not found.missing
            started = time.monotonic()
            assert len(log.read_range_sync(topic, 0, 0, 4000)) == 4000
            ranged.append(time.monotonic() - started)
    finally:
        keys.close()
        asyncio.run(log.close())
    assert min(looked_up) < 0.5 and min(ranged) < 0.9, (looked_up, ranged)


def test_a_read_its_caller_gave_up_on_frees_the_reader_at_once(stack: Stack) -> None:
    """A range read waits for records never written, and its caller gives up after half
    a second: the reader's one thread is free for the next read at once, not when the
    abandoned read's own 30 s deadline passes."""
    topic = f"gave-up-{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.bootstrap, [TopicSpec(topic, 1, {})])
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for i in range(3):
        producer.produce(topic, b"r%d" % i, partition=0)
    assert producer.flush(30) == 0
    log = LogReader(stack.bootstrap, f"{topic}-range", "test")

    async def scenario() -> float:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(log.read_range(topic, 0, 0, 1000, 30.0), 0.5)
        started = time.monotonic()
        assert [r.value for r in await log.read_range(topic, 0, 0, 3, 30.0)] == [
            b"r0", b"r1", b"r2"]
        return time.monotonic() - started

    try:
        took = asyncio.run(scenario())
    finally:
        asyncio.run(log.close())
    assert took < 5, took


def _write_started_turn(bootstrap: str, partition: int, ref: int, request_id: str,
                        text: str, token_ids: tuple[int, ...]) -> None:
    """One live record to ``partition`` of ``chat.live``: turn ``request_id``'s start and
    its first delta."""
    out = PlainWriter(bootstrap, "test-live")
    out.send(LIVE, None, write_batch("test", int(time.time() * 1000), [(ref, 0, request_id)],
                                     [(ref, 0, text, token_ids)], [], [], []), partition)
    assert out.flush(30) == []


def test_a_tailed_partition_whose_fetch_stops_is_read_again(stack: Stack) -> None:
    """librdkafka's fetcher for an assigned partition can stop for good once its brokers
    restart (librdkafka #5153): in the outage suite, after the whole cluster was lost
    twice, one gateway's streams got nothing until their clients gave up. Here the fetch
    is stopped by pausing the partition; a record for a followed turn comes after. The
    tail finds the partition with records to read and none read for ``STALL_S``, reads it
    again from where it stopped (once), and the turn's items come."""
    request_id = f"chatcmpl-stall-{uuid.uuid4().hex[:8]}"
    ref = 2**40  # a reference no turn of the suite has

    async def scenario() -> tuple[list[object], int]:
        meta = LogReader(stack.bootstrap, f"stall-meta-{uuid.uuid4().hex[:8]}", "test")

        tail = GenerationTail(stack.bootstrap, Codec(), meta.ends)
        await tail.start()
        try:
            sub = await tail.follow(request_id, b"stall", 0)
            reader = tail._consumer  # its fetch of chat.live/0 stops, as librdkafka's can
            await reader.call(reader._consumer.pause, [TopicPartition(LIVE, 0)])
            _write_started_turn(stack.bootstrap, 0, ref, request_id, "again", (7,))
            items: list[object] = []
            deadline = time.monotonic() + 3 * STALL_S
            while len(items) < 2 and time.monotonic() < deadline:
                got = await asyncio.wait_for(sub.get(), 3 * STALL_S)
                if got is not None:  # None: a keep-alive was due
                    items.append(got.item)
            return items, tail.rereads
        finally:
            await tail.stop()
            await meta.close()

    items, rereads = asyncio.run(scenario())
    assert items == [Start(0, request_id), Delta(0, "again", (7,))]
    assert rereads == 1


def test_a_partition_whose_add_was_given_up_on_is_tailed_all_the_same(stack: Stack) -> None:
    """A call to Kafka that its caller stopped waiting for (a timeout, a read's deadline)
    still runs to its end on the client's thread: a gateway's add of a tailed partition
    given up on left that partition assigned, and librdkafka refused every later add of it
    (``_CONFLICT``), so each stream of a conversation there failed on that gateway for good.
    Here the add goes through behind the tail's back; the tail's own add of the partition
    then follows it, and a turn's items come."""
    request_id = f"chatcmpl-added-{uuid.uuid4().hex[:8]}"
    ref = 2**40 + 1  # a reference no turn of the suite has

    async def scenario() -> list[object]:
        meta = LogReader(stack.bootstrap, f"added-meta-{uuid.uuid4().hex[:8]}", "test")

        tail = GenerationTail(stack.bootstrap, Codec(), meta.ends)
        await tail.start()
        try:  # the add a timed-out caller left behind, from the start of the topics
            await tail._consumer.add_partitions({(LIVE, 1): 0, (GENERATIONS, 1): 0})
            sub = await tail.follow(request_id, b"added", 1)
            _write_started_turn(stack.bootstrap, 1, ref, request_id, "here", (9,))
            items: list[object] = []
            while len(items) < 2:
                got = await asyncio.wait_for(sub.get(), 30)
                if got is not None:  # None: a keep-alive was due
                    items.append(got.item)
            return items
        finally:
            await tail.stop()
            await meta.close()

    assert asyncio.run(scenario()) == [Start(0, request_id), Delta(0, "here", (9,))]


def test_an_end_read_before_its_turn_is_known_here_reaches_its_follower(
        stack: Stack) -> None:
    """A turn the worker refuses before its first token ends with a failure entry and no
    start entry, and its gateway learns the turn's reference only when its prompt's write
    is answered. Once in the suite, the fan-out read that failure first: it was passed
    over as a turn nobody followed, and the client waited until it gave up. Here the
    failure is read before the follower learns its reference, and reaches it on learning;
    an end that nobody claims is forgotten once every follower knows its turn (a second
    follower of a turn knows it from the first)."""
    request_id = f"chatcmpl-refused-{uuid.uuid4().hex[:8]}"
    ref, other = 2**40 + 2, 2**40 + 3  # references no turn of the suite has
    partition = 2

    async def scenario() -> tuple[object, int, int]:
        meta = LogReader(stack.bootstrap, f"refused-meta-{uuid.uuid4().hex[:8]}", "test")
        tail = GenerationTail(stack.bootstrap, Codec(), meta.ends)
        await tail.start()
        try:
            sub = await tail.follow(request_id, b"refused", partition)
            out = PlainWriter(stack.bootstrap, "refused-live")
            out.send(LIVE, None, write_batch(
                "test", int(time.time() * 1000), [], [], [(other, 0, "stop", 1, 0)],
                [(ref, "context_length_exceeded", "too long")], []), partition)
            assert out.flush(30) == []
            end = (await meta.ends([(LIVE, partition)]))[(LIVE, partition)]
            deadline = time.monotonic() + 30
            while tail._next[(LIVE, partition)] < end:  # the fan-out read the record
                assert time.monotonic() < deadline, "the tail did not read the record"
                await asyncio.sleep(0.01)
            tail.bind(sub, ref)
            got = await asyncio.wait_for(sub.get(), 5)
            held_while_unknown = len(tail._held)
            again = await tail.follow(request_id, b"refused", partition)  # a second client
            assert again.ref == ref  # knows it from the first: no follower left unbound
            tail.unfollow(again)
            tail.unfollow(sub)
            tail._sweep()
            return None if got is None else got.item, held_while_unknown, len(tail._held)
        finally:
            await tail.stop()
            await meta.close()

    item, held_while_unknown, held_after = asyncio.run(scenario())
    assert item == Failure("context_length_exceeded", "too long")
    assert (held_while_unknown, held_after) == (1, 0)  # the unclaimed end, then none


def test_a_stream_whose_live_items_come_with_a_gap_is_filled_from_the_log(
        stack: Stack) -> None:
    """Once, in a race of eight idempotent retries through two gateways, a client's stream
    got seq 0, then seq 5 and on: the gateway's fan-out had not brought seqs 1-4, and the
    client was sent the text without them. Here the fan-out loses them on purpose (its
    subscription drops them), while the log holds them. The stream reads the turn again
    from the log at the gap, and the client gets every delta once, in order. A second
    turn's log lacks seq 2 too: it is read again once, sent with the gap, and ends."""
    settings = GatewaySettings()
    metrics = GatewayMetrics(CollectorRegistry())
    partition = 0

    async def follow_turn(follow: Follow, tail: GenerationTail, lost: set[int],
                          written: list[int]) -> list[object]:
        request_id = f"chatcmpl-gap-{uuid.uuid4().hex[:8]}"
        ref = 2**40 + random.randrange(2**20)  # a reference no turn of the suite has
        sub = await tail.follow(request_id, b"gap", partition)
        tail.bind(sub, ref)
        fan_out = sub.push  # the fan-out loses seqs ``lost`` of this subscription only
        sub.push = lambda d: None if isinstance(d.item, Delta) and d.item.seq in lost \
            else fan_out(d)  # type: ignore[method-assign]
        f = Following(request_id, uuid.uuid4(), "tenant", int(time.time()), "m", sub, [],
                      attachment=request_id)
        out = PlainWriter(stack.bootstrap, "gap-live")
        batches = [([(ref, 0, request_id)], written[:1], []), ([], written[1:5], []),
                   ([], written[5:], [(ref, 8, "stop", 3, 8)])]
        for starts, seqs, ends in batches:
            out.send(LIVE, None, write_batch(
                "gap-test", int(time.time() * 1000), starts,
                [(ref, seq, f"t{seq} ", (seq,)) for seq in seqs], ends, [], []), partition)
        assert out.flush(30) == []
        items: list[object] = []
        async with follow.following(f) as events:
            async for delivered in events:
                if delivered is not None:
                    items.append(delivered.item)
                    if isinstance(delivered.item, End):
                        break
        return items

    async def scenario() -> tuple[list[object], list[object]]:
        meta = LogReader(stack.bootstrap, f"gap-meta-{uuid.uuid4().hex[:8]}", "test")
        reader = LogReader(stack.bootstrap, f"gap-read-{uuid.uuid4().hex[:8]}", "test")
        pool = AsyncConnectionPool(stack.database_url, open=False)  # not read here
        store = ConversationStore(pool, meta, reader, PARTITIONS, Codec(), settings)
        tail = GenerationTail(stack.bootstrap, Codec(), store.ends_of)
        producer = EventProducer(stack.bootstrap)
        await tail.start()
        try:
            follow = Follow(settings, producer, tail, store, metrics)
            filled = await follow_turn(follow, tail, {1, 2, 3, 4}, list(range(8)))
            holed = await follow_turn(follow, tail, set(), [0, 1, 3, 4, 5, 6, 7])
            return filled, holed
        finally:
            await tail.stop()
            producer.close()
            await meta.close()
            await reader.close()

    filled, holed = asyncio.run(scenario())

    def text(items: list[object]) -> str:  # deltas a reader lagged behind come merged
        return "".join(item.text for item in items if isinstance(item, Delta))

    assert text(filled) == "".join(f"t{seq} " for seq in range(8)), filled
    assert text(holed) == "".join(f"t{seq} " for seq in (0, 1, 3, 4, 5, 6, 7)), holed
    assert isinstance(filled[-1], End) and isinstance(holed[-1], End)
    assert metrics.stream_refills._value.get() == 2  # one per turn: once per gap
    assert metrics.stream_gaps._value.get() == 1  # the gap the log has too
