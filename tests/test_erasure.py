"""Erasure that reaches the log: content is sealed with per-conversation data keys, and
deleting or erasing a conversation destroys them (crypto-shredding, docs/erasure.md).
Real Kafka, PostgreSQL, and the vLLM worker with its tiny model; a turn erased while it
runs, on the SIMULATED engine (slow enough to be caught mid-turn)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from infra.process import free_port
from pipeline.codec import CLEAR, bare, conversation_key
from pipeline.erasures import Erasures, erasure_record
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.kek import KeyRef
from pipeline.keystore import Keyring, KeyringLimits, load_kek
from pipeline.settings import CommonSettings
from pipeline.topics import CONTROL, ERASURES, GENERATIONS, KEYS, PROMPTS
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    SessionCreated,
    SessionDeleted,
)
from schemas.conversation import storable
from tests.conftest import (
    MODEL,
    Pipeline,
    Stack,
    idempotent_conversation,
    new_database,
    start_service,
    wait_healthy,
)
from tests.logread import codec_of, deltas_of, end_offsets, read_events, read_records
from tests.replaying import cli, differences
from tests.sse import scrape, stream_chat

pytestmark = pytest.mark.integration


def every_record(bootstrap: str, only: str | None = None) -> list[bytes]:
    """Every record's key, value and headers, of every topic of the cluster (internal
    ones too; or of ``only``), as bytes: what anyone with read access to the log could
    see."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"raw-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
    out = []
    try:
        topics = consumer.list_topics(timeout=10).topics
        for topic in [only] if only else topics:
            ends = end_offsets(bootstrap, topic)
            parts = [p for p, end in ends.items() if end > 0]
            if not parts:
                continue
            consumer.assign([TopicPartition(topic, p, 0) for p in parts])
            remaining = set(parts)
            while remaining:
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error():
                    out.append(b"%s\0%s\0%r" % (msg.key() or b"", msg.value() or b"",
                                                msg.headers()))
                for tp in consumer.position([TopicPartition(topic, p) for p in remaining]):
                    if tp.offset >= ends[tp.partition]:
                        remaining.discard(tp.partition)
    finally:
        consumer.close()
    return out


def chat(pipeline: Pipeline, text: str, session: str | None = None, stream: bool = False,
         user: str | None = None) -> tuple[str, str]:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": MODEL, "max_tokens": 12, "stream": stream,
            "messages": [{"role": "user", "content": text}]}
    if user is not None:
        body["user"] = user
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", headers=headers, json=body,
                   timeout=120)
    assert r.status_code == 200, r.text
    reply = "" if stream else r.json()["choices"][0]["message"]["content"]
    return r.headers["x-session-id"], reply


def contents(pipeline: Pipeline, session: str) -> list[str]:
    r = httpx.get(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30)
    assert r.status_code == 200, r.text
    return [m["content"] for m in r.json()["data"]]


def found_in(records: list[bytes], *texts: str) -> list[str]:
    return [t for t in texts if any(t.encode() in r for r in records)]


def test_content_is_sealed_in_the_log_and_erasure_makes_it_unreadable(
        pipeline: Pipeline) -> None:
    secret = f"my-secret-{uuid.uuid4().hex}"
    titled = httpx.post(f"{pipeline.url}/v1/sessions", json={"title": f"title-{secret}"},
                        timeout=30)
    assert titled.status_code == 201, titled.text
    session = titled.json()["id"]
    _, reply = chat(pipeline, f"remember {secret}", session)
    chat(pipeline, f"and stream {secret}-2", session, stream=True)
    kept_secret = f"kept-{uuid.uuid4().hex}"
    kept, kept_reply = chat(pipeline, f"keep {kept_secret}")
    pipeline.wait_projected()

    # Sealed from the start: no record of any topic holds the text, yet every reader
    # with the keys reads it (the store, the API, the audit command).
    records = every_record(pipeline.stack.bootstrap)
    assert found_in(records, secret, kept_secret) == []
    assert f"remember {secret}" in contents(pipeline, session)
    assert storable(reply) in contents(pipeline, session)  # the tiny model may say NUL
    audit = cli(pipeline.stack, "audit", session, "--json")
    assert audit.returncode == 0 and f"remember {secret}" in audit.stdout, audit.stderr

    erased = cli(pipeline.stack, "erase", "--conversation", session)
    assert erased.returncode == 0, erased.stderr
    assert "erased 1 conversation(s)" in erased.stdout
    pipeline.wait_projected()
    assert httpx.get(f"{pipeline.url}/v1/sessions/{session}", timeout=30).status_code == 404

    # The erasure is recorded, and says nothing of what was erased.
    deletions = [e for _, e in read_events(pipeline.stack.bootstrap, CONTROL)
                 if isinstance(e, SessionDeleted) and str(e.conversation_id) == session]
    assert [d.reason for d in deletions] == ["erased"]
    # Its keys are tombstoned in chat.keys.
    keys = [v for v in every_record(pipeline.stack.bootstrap) if v.startswith(
        session.encode() + b"/")]
    assert keys and any(v.split(b"\0")[1] == b"" for v in keys)

    # Nothing anyone reads brings it back: the raw log holds no trace of the text, a
    # reader with the keys gets the erased prompts empty, the audit shows no text, and a
    # replay into an empty store equals the live store.
    records = every_record(pipeline.stack.bootstrap)
    assert found_in(records, secret) == []
    prompts = [e for _, e in read_events(pipeline.stack.bootstrap, PROMPTS)
               if str(e.conversation_id) == session]
    assert prompts and all(isinstance(p, PromptSubmitted) and p.erased
                           and p.messages[0].content == "" for p in prompts)
    audit = cli(pipeline.stack, "audit", session, "--json")
    assert audit.returncode == 0 and '"sealed"' in audit.stdout, audit.stderr
    assert secret not in audit.stdout and (len(reply) < 8 or reply not in audit.stdout)
    assert differences(pipeline.stack) == {}

    # The other conversation is untouched.
    assert contents(pipeline, kept) == [f"keep {kept_secret}", storable(kept_reply)]


def test_erasing_a_user_erases_their_conversations_only(pipeline: Pipeline) -> None:
    alice, bob = f"alice-{uuid.uuid4().hex[:8]}", f"bob-{uuid.uuid4().hex[:8]}"
    first, _ = chat(pipeline, "alice's first", user=alice)
    second, _ = chat(pipeline, "alice's second", user=alice)
    chat(pipeline, "alice again, in the first", first)
    other, _ = chat(pipeline, "bob's own", user=bob)
    pipeline.wait_projected()

    erased = cli(pipeline.stack, "erase", "--user", alice)
    assert erased.returncode == 0, erased.stderr
    assert "erased 2 conversation(s)" in erased.stdout
    pipeline.wait_projected()
    for session in (first, second):
        assert httpx.get(f"{pipeline.url}/v1/sessions/{session}",
                         timeout=30).status_code == 404
    assert "bob's own" in contents(pipeline, other)
    # Erasing again finds nothing.
    again = cli(pipeline.stack, "erase", "--user", alice)
    assert again.returncode == 1 and "nothing to erase" in again.stderr


def test_deleting_a_session_destroys_its_keys(pipeline: Pipeline) -> None:
    session, _ = chat(pipeline, "delete me and my keys")
    pipeline.wait_projected()
    deleted = httpx.delete(f"{pipeline.url}/v1/sessions/{session}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    records = [r for r in every_record(pipeline.stack.bootstrap)
               if r.startswith(session.encode() + b"/")]
    assert records and records[-1].split(b"\0")[1] == b""  # the last: a tombstone
    prompt = next(e for _, e in read_events(pipeline.stack.bootstrap, PROMPTS)
                  if str(e.conversation_id) == session)
    assert prompt.erased


def keys_in_log(pipeline: Pipeline, conversation: uuid.UUID) -> bool:
    """Whether ``chat.keys`` holds a live key of the conversation (a record whose last
    word is not a tombstone), read raw to its end."""
    last: dict[bytes, bytes] = {}
    for raw in every_record(pipeline.stack.bootstrap, KEYS):
        key, value, _ = raw.split(b"\0", 2)
        if key.startswith(str(conversation).encode() + b"/"):
            last[key] = value
    return any(value for value in last.values())


def test_a_deletion_whose_deleter_died_before_the_keys_still_destroys_them(
        pipeline: Pipeline) -> None:
    """A deleter killed between its ``SessionDeleted`` and its keys' tombstones (a
    gateway, ``pipeline erase``) leaves the deletion alone in the log: the projector
    destroys the keys when it reads it."""
    session, _ = chat(pipeline, "my deleter dies halfway")
    pipeline.wait_projected()
    conversation = uuid.UUID(session)
    prompt = next(e for _, e in read_events(pipeline.stack.bootstrap, PROMPTS)
                  if e.conversation_id == conversation)
    assert keys_in_log(pipeline, conversation)
    writer = PlainWriter(pipeline.stack.bootstrap, "dying-deleter")
    writer.send(CONTROL, conversation_key(conversation), bare(SessionDeleted(
        conversation_id=conversation, request_id=f"delete-{uuid.uuid4().hex}",
        tenant=prompt.tenant, reason="deleted")))
    assert writer.flush(30) == []  # and it writes nothing more
    deadline = time.monotonic() + 60
    while keys_in_log(pipeline, conversation):
        assert time.monotonic() < deadline, "the deleted conversation's keys live on"
        time.sleep(0.5)
    pipeline.wait_projected()  # the keys go just before the batch that deletes it commits
    r = httpx.get(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30)
    assert r.status_code == 404, r.text


def test_a_key_not_found_yet_for_recent_content_is_looked_for_again(
        pipeline: Pipeline) -> None:
    """A reader that finds a key's place past the end of ``chat.keys`` (a broker that lost
    its leadership answers with the end it had: tests/test_network.py isolates one)
    looks again for the key of recent content, and finds it once it is written; content
    older than the erasure window whose key is not where it says reads as erased at
    once (its key and tombstone may both be compacted away)."""
    common = CommonSettings(kafka_bootstrap=pipeline.stack.bootstrap)
    kek = load_kek(common)
    reader = Keyring(pipeline.stack.bootstrap, kek, "late-reader",
                     KeyringLimits(missing_wait_s=60))
    writer = Keyring(pipeline.stack.bootstrap, kek, "late-writer")
    with reader, writer:
        new = writer.new_key(uuid.uuid4(), "t", None)
        end = end_offsets(pipeline.stack.bootstrap, KEYS)[new.partition]
        ref = str(KeyRef(new.short_id, new.partition, end))  # where it will lie
        started = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            looking = pool.submit(reader.for_reading, ref, True, time.time())
            time.sleep(2)  # it looks, does not find, and looks again
            assert not looking.done()
            out = PlainWriter(pipeline.stack.bootstrap, "late-key")
            out.send(KEYS, new.record_key, new.value, new.partition)
            assert out.flush(30) == []
            found = looking.result(60)
        assert found is not None and found.key_id == ref
        assert found.conversation_id == new.conversation_id
        assert time.monotonic() - started < 30
        never = str(KeyRef(new.short_id, new.partition, end + 10_000))
        started = time.monotonic()
        assert reader.for_reading(never, True, time.time() - 2 * 86_400) is None
        assert time.monotonic() - started < 10
        # A partition the topic lacks is never waited for, however recent the content (a
        # forged prompt naming one held its worker's partition for the intake's 120 s).
        nowhere = str(KeyRef(new.short_id, 10_000, 0))
        started = time.monotonic()
        assert reader.for_reading(nowhere, True, time.time()) is None
        assert time.monotonic() - started < 10


def test_a_reader_that_reads_ahead_holds_the_keys_its_fetch_brought(
        stack: Stack) -> None:
    """A keyring that reads ahead (a worker, the projector, a replay: each reads a chat
    topic's partition in order, and finds its keys in that order in ``chat.keys``) holds
    the keys its one fetch brought past the one asked, but for an erased conversation's:
    the next conversations' first prompts cost no fetch more."""
    from pipeline import sealing
    from pipeline.topics import ERASURES

    common = CommonSettings(kafka_bootstrap=stack.bootstrap)
    kek = load_kek(common)
    with Keyring(stack.bootstrap, kek, "ahead-writer") as writer:
        partition = writer.partition_of(uuid.uuid4())
        conversations = []
        while len(conversations) < 8:
            conversation = uuid.uuid4()
            if writer.partition_of(conversation) == partition:
                conversations.append(conversation)
        out = PlainWriter(stack.bootstrap, "ahead-keys")
        out.send(ERASURES, *writer.erasure(conversations[5], "t"))
        assert out.flush(30) == []
        start = end_offsets(stack.bootstrap, KEYS)[partition]
        refs = []
        for n, conversation in enumerate(conversations):  # one producer: offsets in a row
            new = writer.new_key(conversation, "t", None)
            out.send(KEYS, new.record_key, new.value, new.partition)
            refs.append(str(KeyRef(new.short_id, partition, start + n)))
        assert out.flush(30) == []
    for read_ahead in (True, False):
        with Keyring(stack.bootstrap, kek, f"ahead-{read_ahead}",
                     KeyringLimits(read_ahead=read_ahead)) as reader:
            first = reader.for_reading(refs[0])
            assert first is not None and first.conversation_id == conversations[0]
            fetches = reader.fetches
            for n, ref in enumerate(refs[1:], start=1):
                if not read_ahead or n == 5:  # not brought, or refused: not held
                    with pytest.raises(sealing.KeyNotHeld):
                        reader.for_reading(ref, wait=False)
                    continue
                key = reader.for_reading(ref, wait=False)
                assert key is not None and key.conversation_id == conversations[n]
            assert reader.fetches == fetches
            assert reader.for_reading(refs[5]) is None  # fetched, and refused
    # A small cache takes an eighth of itself read ahead, then the key asked: what it
    # brings never pushes that key out.
    with Keyring(stack.bootstrap, kek, "ahead-small",
                 KeyringLimits(read_ahead=True, cache=16)) as small:
        assert small.for_reading(refs[0]) is not None
        assert small.for_reading(refs[0], wait=False) is not None
        assert small.size() == 16 // 8 + 1



def test_the_projector_holds_the_keys_of_its_batch_but_an_erased_conversations(
        stack: Stack) -> None:
    """The projector reads ``chat.keys`` beside the conversations' topics, so each new
    conversation's key came to it in a batch, and was looked up again when the prompt
    sealed with it was opened: a fetch and a look at the erasures' end each (4.3% of the
    broker's requests at 256 x 20, and a thread's round trip). It now holds the batch's
    keys before it opens the batch's events, after one look at the erasures' end, as a
    look-up would: the prompts open with no fetch, and a conversation erased before its
    key was read is not held, so its content reads as erased."""
    import asyncio

    from psycopg import sql

    from pipeline import sealing
    from pipeline.codec import Position
    from pipeline.kafka import Record
    from pipeline.kafka.reader import LogReader
    from projections.migrate import in_schema, migrate
    from projections.projector import apply_batch

    common = CommonSettings(kafka_bootstrap=stack.bootstrap)
    kek = load_kek(common)
    with Keyring(stack.bootstrap, kek, "batch-writer") as writer:
        partition = writer.partition_of(uuid.uuid4())
        conversations: list[uuid.UUID] = []
        while len(conversations) < 3:
            conversation = uuid.uuid4()
            if writer.partition_of(conversation) == partition:
                conversations.append(conversation)
        out = PlainWriter(stack.bootstrap, "batch-keys")
        out.send(ERASURES, *writer.erasure(conversations[2], "t"))  # before its key
        assert out.flush(30) == []
        start = end_offsets(stack.bootstrap, KEYS)[partition]
        news = [writer.new_key(c, "t", None) for c in conversations]
        for new in news:  # one producer: offsets in a row
            out.send(KEYS, new.record_key, new.value, new.partition)
        assert out.flush(30) == []
        keys = [writer.placed(new, start + n) for n, new in enumerate(news)]
        prompts = [Record(Position(PROMPTS, partition, n), conversation_key(c),
                          writer.codec.encode(PromptSubmitted(
                              conversation_id=c, request_id=f"held-{n}", model=MODEL,
                              messages=(ChatMessage(role="user", content=f"said {n}"),)),
                              keys[n]), 0)
                   for n, c in enumerate(conversations[:2])]
    reader = LogReader(stack.bootstrap, "batch-keys-read", "test")
    try:
        records = reader.read_range_sync(KEYS, partition, start, start + 3)
    finally:
        asyncio.run(reader.close())
    assert len(records) == 3

    schema = f"held_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    migrate(stack.database_url, schema=schema)
    with Keyring(stack.bootstrap, kek, "batch-projector") as projector:
        fetches = projector.fetches  # its start's

        async def project() -> None:
            async with await psycopg.AsyncConnection.connect(
                    in_schema(stack.database_url, schema), autocommit=True) as conn:
                batch = await apply_batch(
                    conn, [*records, *prompts], projector.codec,
                    hold_keys=lambda keys: asyncio.to_thread(projector.hold_read, keys))
                assert not batch.parked, batch.parked

        asyncio.run(project())
        assert projector.fetches == fetches  # each prompt opened with a key its batch held
        with psycopg.connect(in_schema(stack.database_url, schema)) as conn:
            stored = conn.execute("SELECT content FROM messages ORDER BY content").fetchall()
        assert stored == [("said 0",), ("said 1",)]
        assert projector.hold_read(records) == 0  # held already; the erased one, never
        with pytest.raises(sealing.KeyNotHeld):
            projector.for_reading(keys[2].key_id, wait=False)
        assert projector.for_reading(keys[2].key_id) is None  # looked up, and refused


def test_a_worker_reads_the_keys_of_a_polled_batch_together(stack: Stack) -> None:
    """Each new conversation's key cost a worker a fetch of ``chat.keys`` and a look at
    the erasures' end, its prompts' lanes one after another. The keys a polled batch of
    prompts names are read together (``Keyring.prefetch``): one fetch over their
    partitions and one look, as each look-up would; an erased conversation's key is not
    held, and a place no topic has (a hostile box's) is read by no one: the Kafka client
    refused it with an OverflowError, which stopped the worker that looked it up."""
    from pipeline import sealing

    common = CommonSettings(kafka_bootstrap=stack.bootstrap)
    kek = load_kek(common)
    with Keyring(stack.bootstrap, kek, "batch-writer-2") as writer:
        first = writer.partition_of(uuid.uuid4())
        conversations: list[uuid.UUID] = []
        while len(conversations) < 3:  # two in one partition, one in another
            conversation = uuid.uuid4()
            if (writer.partition_of(conversation) == first) == (len(conversations) < 2):
                conversations.append(conversation)
        out = PlainWriter(stack.bootstrap, "batch-keys-2")
        out.send(ERASURES, *writer.erasure(conversations[1], "t"))  # before its key
        assert out.flush(30) == []
        ends = end_offsets(stack.bootstrap, KEYS)
        refs = []
        for conversation in conversations:  # one producer: offsets in a row
            new = writer.new_key(conversation, "t", None)
            out.send(KEYS, new.record_key, new.value, new.partition)
            refs.append(str(KeyRef(new.short_id, new.partition, ends[new.partition])))
            ends[new.partition] += 1
        assert out.flush(30) == []
    with Keyring(stack.bootstrap, kek, "batch-worker") as reader:
        fetches = reader.fetches  # its start's
        assert reader.prefetch(dict.fromkeys(refs, time.time())) == 2
        assert reader.fetches == fetches + 1
        for n in (0, 2):
            key = reader.for_reading(refs[n], wait=False)
            assert key is not None and key.conversation_id == conversations[n]
        with pytest.raises(sealing.KeyNotHeld):  # erased before its key was read
            reader.for_reading(refs[1], wait=False)
        assert reader.prefetch(dict.fromkeys(refs[::2], None)) == 0  # held: no read
        assert reader.fetches == fetches + 1
        far = ["a.0.99999999999999999999999", f"a.{2**31}.0", "a.99.0", "a.b.c"]
        assert reader.prefetch(dict.fromkeys(far, None)) == 0
        assert reader.fetches == fetches + 1
        for ref in far[:2] + far[3:]:
            started = time.monotonic()
            assert reader.for_reading(ref) is None  # reads as erased, and stops no one
            assert time.monotonic() - started < 5, ref

def test_a_reader_without_the_keys_reads_content_as_erased(pipeline: Pipeline) -> None:
    session, _ = chat(pipeline, "for keyholders only")
    raw = next(value for _, value, _ in _prompts(pipeline) if session.encode() in value)
    opened = codec_of(pipeline.stack.bootstrap).decode(raw)  # with the cluster's keyring
    assert opened.messages[0].content == "for keyholders only"  # type: ignore[union-attr]
    blind = CLEAR.decode(raw)
    assert blind.erased and blind.messages[0].content == ""  # type: ignore[union-attr]


def _prompts(pipeline: Pipeline) -> list[tuple[object, bytes, object]]:
    from tests.logread import read_records

    return [(p, v, h) for p, v, h in read_records(pipeline.stack.bootstrap, PROMPTS)
            if v is not None]


def test_the_key_topic_is_compacted_within_the_erasure_window(pipeline: Pipeline) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": pipeline.stack.bootstrap})
    resource = ConfigResource(ConfigResource.Type.TOPIC, KEYS)
    config = admin.describe_configs([resource])[resource].result(timeout=10)
    assert config["cleanup.policy"].value == "compact"
    assert int(config["max.compaction.lag.ms"].value) == 24 * 3600 * 1000


SLOW_RATE = 10  # simulated tokens/s: a turn of 400 tokens runs 40 s
SMALL_CACHE = 16  # data keys each of its processes holds at most


@pytest.fixture(scope="module")
def slow(sim_stack: Stack) -> Iterator[Pipeline]:
    """A gateway, a SIMULATED-engine worker and a projector on the SIMULATED stack, each
    holding ``SMALL_CACHE`` data keys at most."""
    stack = Stack(sim_stack.bootstrap, new_database(sim_stack.database_url, "erasure"),
                  sim_stack.logs)
    port = free_port()
    small = {"PIPELINE_KEY_CACHE": str(SMALL_CACHE)}
    services = {
        "projector": start_service(stack, "erase-projector", "projector", **small),
        "worker": start_service(stack, "erase-worker", "worker", "--engine", "sim",
                                WORKER_SIM_TOKENS_PER_S=str(SLOW_RATE), **small),
        "gateway": start_service(stack, "erase-gateway", "gateway", "--port", str(port),
                                 GATEWAY_MODELS="sim", **small),
    }
    p = Pipeline(stack, f"http://127.0.0.1:{port}", services)
    try:
        wait_healthy(p.url, list(services.values()), timeout=60)
        yield p
    finally:
        for s in services.values():
            s.stop()


def test_a_conversation_erased_mid_turn_stops_and_nothing_of_it_reads(slow: Pipeline) -> None:
    """Erased while its turn streams: the turn stops (its stream ends long before its 400
    tokens), and every text it wrote, before the erasure and after, reads as erased to a
    reader holding every live key."""
    key = uuid.uuid4().hex
    conversation = idempotent_conversation(key)
    body = {"model": "sim", "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"talk a long time {key}"}]}
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_chat, slow.url, body, headers={"Idempotency-Key": key},
                                timeout=120)
        time.sleep(3)  # about 30 tokens streamed
        assert not streaming.done()
        erasing = time.monotonic()
        erased = cli(slow.stack, "erase", "--conversation", str(conversation))
        assert erased.returncode == 0, erased.stderr
        streamed = streaming.result(timeout=90)
        stopped_s = time.monotonic() - erasing
    assert streamed.status == 200 and streamed.text, streamed
    assert stopped_s < 15 and streamed.content_chunks() < 400, (stopped_s, streamed)
    slow.wait_projected()
    assert httpx.get(f"{slow.url}/v1/sessions/{conversation}", timeout=30).status_code == 404
    # The live stream: the turn's text was written, and none of it opens any more.
    deltas = deltas_of(slow.stack.bootstrap, streamed.request_id)
    assert deltas and all(d.text == "" and d.token_ids == () for d in deltas), deltas[:3]
    # The durable record: its prompt and its end hold no text.
    ours = [e for _, e in read_events(slow.stack.bootstrap, PROMPTS)
            + read_events(slow.stack.bootstrap, GENERATIONS)
            if e.conversation_id == conversation]
    prompts = [e for e in ours if isinstance(e, PromptSubmitted)]
    ends = [e for e in ours if isinstance(e, (GenerationFinished, GenerationFailed))]
    assert prompts and all(p.erased and p.messages[0].content == "" for p in prompts)
    assert ends and all(not getattr(e, "text", "") for e in ends), ends


def sim_chat(pipeline: Pipeline, text: str, session: str | None = None) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    return httpx.post(f"{pipeline.url}/v1/chat/completions", headers=headers, timeout=120,
                      json={"model": "sim", "max_tokens": 2,
                            "messages": [{"role": "user", "content": text}]})


def test_processes_with_a_bounded_key_cache_serve_conversations_beyond_it(
        slow: Pipeline) -> None:
    """Four times as many conversations as the gateway, the worker and the projector hold
    keys for: each one's next turn is served, sealed with the key it already had (no
    new key made for it), and stored readable."""
    sessions = 4 * SMALL_CACHE
    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(lambda n: sim_chat(slow, f"first {n}"), range(sessions)))
    assert all(r.status_code == 200 for r in firsts), [r.text for r in firsts][:3]
    ids = [r.headers["x-session-id"] for r in firsts]
    slow.wait_projected()
    with ThreadPoolExecutor(8) as pool:
        seconds = list(pool.map(lambda n: sim_chat(slow, f"second {n}", ids[n]),
                                range(sessions)))
    assert all(r.status_code == 200 for r in seconds), [r.text for r in seconds][:3]
    slow.wait_projected()
    with psycopg.connect(slow.stack.database_url) as conn:
        keys = dict(conn.execute(
            "SELECT conversation_id::text, count(*) FROM data_keys"
            " WHERE conversation_id::text = ANY(%s) GROUP BY 1", (ids,)).fetchall())
    assert keys == dict.fromkeys(ids, 1)  # one key each: the second turn reused it
    for n in (0, sessions // 2, sessions - 1):
        texts = contents(slow, ids[n])
        assert texts[0] == f"first {n}" and texts[2] == f"second {n}", texts
    records = every_record(slow.stack.bootstrap, PROMPTS)
    assert found_in(records, f"second {sessions - 1}") == []


def test_a_destroyed_key_is_unreadable_to_every_reader_at_once(slow: Pipeline) -> None:
    """A session deleted while its key's record is still in chat.keys (the broker
    compacts it within the erasure window): a keyring that held the key, a keyring
    that fetches it where its reference says, the audit, a replay and the API all read
    the session as erased within moments."""
    r = sim_chat(slow, "read me never again")
    assert r.status_code == 200, r.text
    session = r.headers["x-session-id"]
    slow.wait_projected()
    prompt_record = next(v for _, v, _ in read_records(slow.stack.bootstrap, PROMPTS)
                         if v is not None and session.encode() in v)
    assert prompt_record is not None
    ref = json.loads(prompt_record)["sealed"]["key"]
    common = CommonSettings(kafka_bootstrap=slow.stack.bootstrap)
    holder = Keyring(slow.stack.bootstrap, load_kek(common), "holder").start()
    try:
        assert holder.for_reading(ref) is not None  # held from now on
        deleted = httpx.delete(f"{slow.url}/v1/sessions/{session}", timeout=30)
        assert deleted.status_code == 200, deleted.text
        deadline = time.monotonic() + 5
        while holder.for_reading(ref) is not None:
            assert time.monotonic() < deadline, "a keyring kept a destroyed key"
            time.sleep(0.05)
        assert keys_in_log_at(slow, ref)  # not compacted yet: found only by its place
        with Keyring(slow.stack.bootstrap, load_kek(common), "fetcher") as fetcher:
            before = fetcher.fetches
            assert fetcher.for_reading(ref) is None
            assert fetcher.fetches == before + 1  # it did read the record, and refused it
        assert holder.codec.decode(prompt_record).erased  # it held the key
    finally:
        holder.close()
    audit = cli(slow.stack, "audit", session, "--json")
    assert audit.returncode == 0 and "read me never again" not in audit.stdout, audit.stderr
    slow.wait_projected()
    assert httpx.get(f"{slow.url}/v1/sessions/{session}", timeout=30).status_code == 404
    assert differences(slow.stack) == {}


def keys_in_log_at(pipeline: Pipeline, ref: str) -> bool:
    """Whether the record a key reference names is still in ``chat.keys``."""
    place = KeyRef.parse(ref)
    assert place is not None
    return any((position.partition, position.offset) == (place.partition, place.offset)
               and value is not None
               for position, value, _ in read_records(pipeline.stack.bootstrap, KEYS))


def test_the_ends_a_keyring_waits_for_are_the_partitions_ends(pipeline: Pipeline) -> None:
    """A keyring refuses a key it fetched after its conversation's erasure once it has
    read ``chat.erasures`` to the ends it asks (``Keyring._look_up``). Those ends, asked
    in one request, are the partitions' ends: of one partition and of several."""
    reader = PlainReader(pipeline.stack.bootstrap, f"ends-{uuid.uuid4().hex[:8]}")
    try:
        writer = PlainWriter(pipeline.stack.bootstrap, "ends-writer")
        writer.send(ERASURES, *erasure_record(uuid.uuid4(), "ends", "test"))
        assert writer.flush(30) == []
        for topic in (ERASURES, KEYS):
            partitions = reader.partitions(topic)
            ends = reader.ends(topic, partitions)
            assert ends == {p: reader.bounds(topic, p)[1] for p in partitions}
        assert len(ends) > 1  # chat.keys: several partitions in one request
        assert reader.ends(ERASURES, [0])[0] >= 1  # the erasure written above
    finally:
        reader.close()


def test_callers_that_wait_for_the_erasures_together_share_an_ask_of_the_ends(
        stack: Stack) -> None:
    """Each look-up of a key waits until ``chat.erasures`` is read to the ends asked after
    it began; under load that was one request to the broker per new conversation. Callers
    that come while an ask is under way now wait for the next one, made once for all of
    them: 16 callers at once cost 2 asks here (the one under way when they came, and
    theirs), each caller's answer is from an ask begun after it called, and an erasure
    written before the callers came is in what each of them waited for."""
    erasures = Erasures(stack.bootstrap, f"shared-{uuid.uuid4().hex[:8]}", 3600.0)
    erasures.start()
    try:
        asks: list[tuple[float, float]] = []  # each ask's start and end (monotonic)
        asker = erasures._asker_()
        ask = asker.ends

        def slow_ask(topic: str, partitions: list[int], timeout: float) -> dict[int, int]:
            began = time.monotonic()
            time.sleep(0.2)  # long enough for every caller to come meanwhile
            try:
                return ask(topic, partitions, timeout)
            finally:
                asks.append((began, time.monotonic()))

        asker.ends = slow_ask  # type: ignore[method-assign,assignment]
        erased = uuid.uuid4()
        writer = PlainWriter(stack.bootstrap, "shared-ends")
        writer.send(ERASURES, *erasure_record(erased, "shared", "test"))
        assert writer.flush(30) == []

        def caller() -> tuple[float, bool, bool, float]:
            called = time.monotonic()
            caught_up = erasures.catch_up()
            return called, caught_up, erasures.revoked(erased), time.monotonic()

        with ThreadPoolExecutor(16) as pool:
            first = pool.submit(caller)
            time.sleep(0.05)  # the first ask is under way
            others = [pool.submit(caller) for _ in range(15)]
            results = [future.result() for future in (first, *others)]
        assert all(caught_up and revoked for _, caught_up, revoked, _ in results)
        assert len(asks) == 2, asks
        for called, _, _, returned in results:
            assert any(called <= began and ended <= returned for began, ended in asks)
    finally:
        erasures.close()


def test_a_deleted_sessions_history_leaves_the_workers_memory(pipeline: Pipeline) -> None:
    """The worker keeps a session's history between its turns; the session's deletion
    drops it from the worker's cache (its characters leave the gauge)."""

    def kept() -> float:
        return scrape(pipeline.worker_metrics)["worker_history_cache_chars"]

    before = kept()
    session, _ = chat(pipeline, "keep my history " + "hello " * 100)
    deadline = time.monotonic() + 30
    while kept() < before + 600:
        assert time.monotonic() < deadline, "the worker kept no history"
        time.sleep(0.2)
    held = kept()  # other turns' histories may come and go meanwhile, none this long
    deleted = httpx.delete(f"{pipeline.url}/v1/sessions/{session}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    deadline = time.monotonic() + 30
    while kept() > held - 600:
        assert time.monotonic() < deadline, "the deleted session's history stayed"
        time.sleep(0.2)


def test_erasing_a_conversation_takes_its_tenant_from_the_store(pipeline: Pipeline) -> None:
    """`erase --conversation` erases another tenant's conversation as that tenant's (the
    projector drops it), and refuses a --tenant that is not its own."""
    conversation = uuid.uuid4()
    writer = PlainWriter(pipeline.stack.bootstrap, "other-tenant")
    writer.send(CONTROL, conversation_key(conversation), bare(SessionCreated(
        conversation_id=conversation, request_id=f"session-{uuid.uuid4().hex}",
        tenant="acme")))
    assert writer.flush(30) == []
    pipeline.wait_projected()
    wrong = cli(pipeline.stack, "erase", "--conversation", str(conversation),
                "--tenant", "default")
    assert wrong.returncode == 1 and "is not tenant 'default'" in wrong.stderr, wrong.stderr
    erased = cli(pipeline.stack, "erase", "--conversation", str(conversation))
    assert erased.returncode == 0, erased.stderr
    pipeline.wait_projected()
    with psycopg.connect(pipeline.stack.database_url) as conn:
        row = conn.execute("SELECT tenant, deleted FROM conversations WHERE id = %s",
                           (conversation,)).fetchone()
    assert row == ("acme", True)
