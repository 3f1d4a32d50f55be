"""The store is exactly the log: replay equality, point-in-time replay, audit, projectors
killed mid-load and sharing a group, and events the store refuses (real Kafka, Postgres)."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

import httpx
import psycopg
import psycopg.conninfo
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg import sql

from infra.process import free_port
from pipeline.codec import CLEAR
from pipeline.kafka import GroupStatus
from pipeline.topics import CONVERSATION_TOPICS, DEADLETTER, GENERATIONS, LIVE, PROMPTS
from projections.migrate import migrate
from projections.settings import ProjectorSettings
from schemas import GenerationFinished, Usage
from tests.conftest import MODEL, Pipeline, Service, Stack, start_service
from tests.logread import end_offsets, read_records
from tests.replaying import TABLES, cli, replay_into_new_schema, snapshot

pytestmark = pytest.mark.integration


def turn(pipeline: Pipeline, text: str, session: str | None = None, max_tokens: int = 6) -> str:
    headers = {"X-Session-Id": session} if session else {}
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r.headers["x-session-id"]


def test_replay_rebuilds_an_identical_store(pipeline: Pipeline) -> None:
    session = turn(pipeline, "replay me")
    turn(pipeline, "and again", session)
    forgotten = turn(pipeline, "forget me")
    deleted = httpx.delete(f"{pipeline.url}/v1/sessions/{forgotten}", timeout=30)
    assert deleted.status_code == 200, deleted.text
    pipeline.wait_projected()
    schema = replay_into_new_schema(pipeline.stack)
    live = snapshot(pipeline.stack.database_url, "public")
    rebuilt = snapshot(pipeline.stack.database_url, schema)
    for table in TABLES:
        assert rebuilt[table] == live[table], table
    assert len(live["messages"]) >= 4
    # The deletion is part of the log: the rebuilt store forgets that session too.
    row = next(r for r in rebuilt["conversations"] if str(r[0]) == forgotten)
    assert row[2] is None and row[5] is True  # no title, deleted
    assert not [m for m in rebuilt["messages"] if str(m[0]) == forgotten]

    # A replay never writes over a store that holds data.
    again = cli(pipeline.stack, "replay", "--from-beginning", "--schema", schema)
    assert again.returncode == 2 and "already holds" in again.stderr


def test_point_in_time_replay(pipeline: Pipeline) -> None:
    before = turn(pipeline, "before the moment")
    time.sleep(0.05)
    moment = datetime.now(UTC)
    time.sleep(0.05)
    after = turn(pipeline, "after the moment")
    pipeline.wait_projected()
    schema = replay_into_new_schema(pipeline.stack, "--until", moment.isoformat())
    rebuilt = snapshot(pipeline.stack.database_url, schema)
    ids = {str(row[0]) for row in rebuilt["conversations"]}
    assert before in ids and after not in ids
    messages = [(str(m[0]), m[1], m[2]) for m in rebuilt["messages"] if str(m[0]) == before]
    assert messages == [(before, 0, "user"), (before, 1, "assistant")]


def test_audit_prints_a_sessions_history_from_the_log(pipeline: Pipeline) -> None:
    session = turn(pipeline, "audit me")
    turn(pipeline, "second turn", session)
    done = cli(pipeline.stack, "audit", session, "--json")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    entries = [e for e in lines if "event" in e]
    kinds = [e["event"]["type"] for e in entries]
    assert kinds[0] == "PromptSubmitted" and kinds.count("PromptSubmitted") == 2
    assert kinds.count("GenerationStarted") == 2 and kinds.count("GenerationFinished") == 2
    assert all(e["event"]["conversation_id"] == session for e in entries)
    assert {e["topic"] for e in entries} == {PROMPTS, GENERATIONS}
    assert all(isinstance(e["offset"], int) for e in entries)
    # What the model was given for each turn, rebuilt from the log: the second turn's
    # input is the whole session, and it is what the gateway said it read.
    first, second = [e for e in entries if e["event"]["type"] == "PromptSubmitted"]
    reply = next(e["event"]["text"] for e in entries
                 if e["event"]["type"] == "GenerationFinished"
                 and e["event"]["request_id"] == first["event"]["request_id"])
    assert [m["content"] for m in first["model_input"]] == ["audit me"]
    assert [(m["role"], m["content"]) for m in second["model_input"]] == [
        ("user", "audit me"), ("assistant", reply), ("user", "second turn")]
    assert (first["history_digest_matches"], second["history_digest_matches"]) == (None, True)
    # Each turn's deltas, while the live stream keeps them.
    live = [e for e in lines if "entry" in e]
    assert {e["topic"] for e in live} == {LIVE}
    assert {e["request_id"] for e in live} == {e["event"]["request_id"] for e in (first, second)}
    assert "".join(e["text"] for e in live if e["entry"] == "Delta"
                   and e["request_id"] == first["event"]["request_id"]) == reply

    text = cli(pipeline.stack, "audit", session)
    assert text.returncode == 0
    assert "PromptSubmitted" in text.stdout and "model input: 3 messages" in text.stdout
    assert "digest matches" in text.stdout and "chat.live" in text.stdout
    assert cli(pipeline.stack, "audit", str(uuid.uuid4())).returncode == 1


def test_event_the_store_refuses_is_dead_lettered_and_projection_goes_on(
    pipeline: Pipeline,
) -> None:
    # Valid by the schema, but past Postgres' integer range: the store refuses it.
    poison = GenerationFinished(
        conversation_id=uuid.uuid4(), request_id=f"poison-{uuid.uuid4()}", model=MODEL,
        reply_seq=2**40, finish_reason="stop", text="x", deltas=1, duration_ms=1,
        usage=Usage(prompt_tokens=1, completion_tokens=1))
    producer = Producer({"bootstrap.servers": pipeline.stack.bootstrap,
                         "partitioner": "murmur2_random", "enable.idempotence": True})
    producer.produce(GENERATIONS, key=str(poison.conversation_id).encode(),
                     value=CLEAR.encode(poison))
    assert producer.flush(10) == 0
    session = turn(pipeline, "still projecting?")
    pipeline.wait_projected()
    reasons = [h["reason"].decode() for _, value, h in read_records(pipeline.stack.bootstrap,
                                                                      DEADLETTER)
               if h.get("consumer") == b"projector" and value == CLEAR.encode(poison)]
    assert len(reasons) == 1 and "rejected by the store" in reasons[0]
    r = httpx.get(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30)
    assert [m["role"] for m in r.json()["data"]] == ["user", "assistant"]
    # The refused event left nothing half-written.
    with psycopg.connect(pipeline.stack.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM generations WHERE request_id = %s",
                            (poison.request_id,)).fetchone() == (0,)


def test_projectors_killed_under_load_and_sharing_a_group_leave_an_exact_store(
    pipeline: Pipeline,
) -> None:
    """Extra projectors join the group (partitions are shared), and are SIGKILLed and
    restarted while turns flow. Afterwards the store equals a replay of the log."""

    def extra() -> Service:
        return start_service(pipeline.stack, "projector-extra", "projector",
                             PROJECTOR_SESSION_TIMEOUT_MS="6000",
                             PROJECTOR_BATCH_MAX_EVENTS="20")

    extras = [extra(), extra()]
    sessions: list[str] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for i in range(24):
                sessions.append(turn(pipeline, f"load turn {i}", max_tokens=8))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    kills = 0
    try:
        while any(t.is_alive() for t in threads) or kills < 4:
            time.sleep(1.5)
            victim = extras[kills % len(extras)]
            victim.kill()
            extras[kills % len(extras)] = extra()
            kills += 1
        for t in threads:
            t.join()
        assert not errors, errors
        pipeline.wait_projected(timeout=90)
    finally:
        for s in extras:
            s.stop()
    assert kills >= 4 and len(sessions) == 48

    schema = replay_into_new_schema(pipeline.stack)
    live = snapshot(pipeline.stack.database_url, "public")
    rebuilt = snapshot(pipeline.stack.database_url, schema)
    for table in TABLES:
        assert rebuilt[table] == live[table], table
    by_conversation: dict[str, list[str]] = {}
    for row in live["messages"]:
        by_conversation.setdefault(str(row[0]), []).append(row[2])
    assert all(by_conversation[s] == ["user", "assistant"] for s in sessions)
    finished = [r for r in live["generations"] if str(r[1]) in set(sessions)]
    assert len(finished) == 48 and {r[5] for r in finished} == {"finished"}


def test_projection_lag_is_exposed_as_metrics(pipeline: Pipeline) -> None:
    port = free_port()
    extra = start_service(pipeline.stack, "projector-metrics", "projector",
                          PROJECTOR_METRICS_PORT=str(port))
    try:
        turn(pipeline, "measure my lag")
        pipeline.wait_projected()
        deadline = time.monotonic() + 30
        while True:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                values = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
                          if line.startswith("projector_lag_")}
                if values.get("projector_lag_events") == 0.0:
                    break
            except httpx.HTTPError:
                values = {}
            assert time.monotonic() < deadline, f"lag metrics never reached 0: {values}"
            time.sleep(0.3)
        assert values == {"projector_lag_events": 0.0, "projector_lag_seconds": 0.0}
        assert "projector_batch_seconds_count" in body
    finally:
        extra.stop()


def test_the_read_model_and_the_store_apply_the_same_rules(stack: Stack) -> None:
    """The same events, fed to the gateway's read model and to the projection (into an
    empty schema of the real PostgreSQL): titles, stored text, turn statuses, void
    prompts, deletion and another tenant's event come out the same."""
    import asyncio

    from gateway.view import ConversationView
    from pipeline.codec import Position
    from pipeline.kafka import Record
    from projections.migrate import in_schema, migrate
    from projections.projector import apply_batch
    from schemas import (
        ChatMessage,
        GenerationFailed,
        GenerationStarted,
        PromptSubmitted,
        SessionCreated,
        SessionDeleted,
    )

    a, b, c, gone = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    def prompt(conv: uuid.UUID, rid: str, texts: list[str], history_end: int | None,
               history: int = 0, tenant: str = "default") -> PromptSubmitted:
        said = tuple(ChatMessage(role="user", content=t) for t in texts)
        return PromptSubmitted(conversation_id=conv, request_id=rid, model=MODEL,
                               tenant=tenant, history_len=history, history_end=history_end,
                               history=said[:history] or None, messages=said[history:])

    def finished(conv: uuid.UUID, rid: str, reply_seq: int, text: str,
                 reason: str = "stop") -> GenerationFinished:
        return GenerationFinished(conversation_id=conv, request_id=rid, model=MODEL,
                                  reply_seq=reply_seq, finish_reason=reason, text=text,  # type: ignore[arg-type]
                                  usage=Usage(prompt_tokens=1, completion_tokens=1),
                                  deltas=1, duration_ms=1)

    prompts = [  # chat.prompts, offsets 0..
        prompt(a, "a1", ["  first\x00  message  "], None),
        prompt(a, "a2", ["first\x00  message", "reply\x00 one", "racing"], 1, history=2),
        prompt(a, "a3", ["first\x00  message", "reply\x00 one", "too late"], 1,
               history=2),  # void
        prompt(a, "a9", ["intruder"], None, tenant="mallory"),
        prompt(b, "b1", ["b's"], None),
        prompt(gone, "g1", ["to go"], None),
    ]
    control = [SessionCreated(conversation_id=b, request_id="sb", title="  b\x00 title  "),
               SessionCreated(conversation_id=c, request_id="sc", title="  c\x00   title  "),
               SessionDeleted(conversation_id=gone, request_id="dg")]
    generations = [
        GenerationStarted(conversation_id=a, request_id="a1", model=MODEL, worker="w",
                          reply_seq=1, prompt_tokens=1),
        finished(a, "a1", 1, "reply\x00 one"),
        finished(a, "a2", 3, "", reason="abort"),
        GenerationFailed(conversation_id=b, request_id="b1", code="engine_dead", message="x"),
        finished(gone, "g1", 1, "lost"),
    ]
    logs = {PROMPTS: prompts, "chat.control": control, GENERATIONS: generations}

    def read_in(order: tuple[str, ...]) -> tuple[dict[uuid.UUID, ConversationView], str]:
        """The views and a schema of the store, each fed every topic whole in ``order``
        (a replay reads the topics in no set order between them)."""
        views = {conv: ConversationView(conv) for conv in (a, b, c, gone)}
        records = []
        for topic in order:
            for offset, event in enumerate(logs[topic]):
                views[event.conversation_id].apply(event, offset)
                records.append(Record(Position(topic, 0, offset), None, CLEAR.encode(event), 0))
        schema = f"rules_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(stack.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        migrate(stack.database_url, schema=schema)

        async def project_all() -> None:
            async with await psycopg.AsyncConnection.connect(
                    in_schema(stack.database_url, schema), autocommit=True) as conn:
                await apply_batch(conn, records, CLEAR)

        asyncio.run(project_all())
        return views, schema

    def shown(view: ConversationView) -> tuple[object, ...]:
        return (view.tenant, view.title, view.deleted, view.created_at, view.updated_at,
                view.memory_user, view.messages, view.void,
                {r: t.status for r, t in view.turns.items()})

    orders = list(itertools.permutations(logs))
    views, schema = read_in(orders[0])
    for order in orders[1:]:  # every order of the topics: the same views, the same rows
        other_views, other_schema = read_in(order)
        assert {c: shown(v) for c, v in other_views.items()} == \
            {c: shown(v) for c, v in views.items()}, order
        assert snapshot(stack.database_url, other_schema) == \
            snapshot(stack.database_url, schema), order
    with psycopg.connect(in_schema(stack.database_url, schema)) as conn:
        stored_titles = dict(conn.execute("SELECT id, title FROM conversations").fetchall())
        stored_messages = conn.execute("SELECT conversation_id, seq, role, content FROM messages"
                                       " ORDER BY 1, 2").fetchall()
        stored_statuses = dict(conn.execute("SELECT request_id, status FROM generations"))
        stored_ends = {r: (reason, tokens, (code, message) if code else None) for
                       r, reason, tokens, code, message in conn.execute(
                           "SELECT request_id, finish_reason, completion_tokens, error_code,"
                           " error_message FROM generations")}
        deleted = {c for (c,) in conn.execute("SELECT id FROM conversations WHERE deleted")}
    assert {conv: v.title for conv, v in views.items()} == stored_titles
    assert sorted((conv, seq, m.role, m.content) for conv, v in views.items()
                  for seq, m in v.messages.items()) == stored_messages
    assert {r: t.status for v in views.values() for r, t in v.turns.items()} == stored_statuses
    assert {r: (t.finish_reason, t.usage.completion_tokens if t.usage else None, t.error)
            for v in views.values() for r, t in v.turns.items()} == stored_ends
    assert {conv for conv, v in views.items() if v.deleted} == deleted == {gone}
    # What the rules say, spelled out (a session's own title, else its first message's):
    assert stored_titles[a] == "first\ufffd message" and stored_titles[b] == "b\ufffd title"
    assert stored_titles[c] == "c\ufffd title"
    assert "a3" not in stored_statuses and views[a].void == {"a3": "a2"}  # void: no trace
    assert "a9" not in stored_statuses  # another tenant's turn changes nothing
    assert stored_statuses == {"a1": "finished", "a2": "cancelled", "b1": "failed",
                               "g1": "finished"}


def test_lag_tools_see_a_restarted_projector_at_the_logs_end(pipeline: Pipeline) -> None:
    """The projector's real positions are in PostgreSQL; it mirrors them into its Kafka
    group for lag tools (``kafka-consumer-groups``, the benchmarks' wait). One started on
    a log it had already projected moved no position, so it mirrored none, and the
    group's lag stayed wherever the Kafka offsets had been left (3,194 records behind
    after a benchmark)."""
    turn(pipeline, "project me")
    pipeline.wait_projected()
    projector = pipeline.services["projector"]
    projector.stop()
    stale = Consumer({"bootstrap.servers": pipeline.stack.bootstrap,
                      "group.id": ProjectorSettings().group, "enable.auto.commit": False})
    try:  # the group's mirrored offsets left behind, as by an older projector
        stale.commit(offsets=[TopicPartition(topic, p, 0) for topic in CONVERSATION_TOPICS
                              for p in end_offsets(pipeline.stack.bootstrap, topic)],
                     asynchronous=False)
    finally:
        stale.close()
    pipeline.services["projector"] = start_service(pipeline.stack, "projector", "projector")
    status = GroupStatus(pipeline.stack.bootstrap, ProjectorSettings().group)
    try:
        deadline = time.monotonic() + 60
        while True:
            behind = {(topic, p): end - at for topic in CONVERSATION_TOPICS
                      for p, (at, end) in status.per_partition(topic).items() if end > at}
            if not behind:
                break
            assert time.monotonic() < deadline, f"lag tools still see {behind} behind"
            time.sleep(0.5)
    finally:
        status.close()


def test_a_database_not_in_utf8_is_refused_with_its_reason(stack: Stack) -> None:
    """A store the pipeline cannot read text back from (SQL_ASCII: a cluster made without a
    locale, whose text psycopg returns as bytes) is refused before any migration."""
    name = f"ascii_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} ENCODING 'SQL_ASCII' LC_COLLATE 'C' "
                             "LC_CTYPE 'C' TEMPLATE template0").format(sql.Identifier(name)))
    try:
        url = psycopg.conninfo.make_conninfo(stack.database_url, dbname=name)
        done = subprocess.run([sys.executable, "-m", "launch", "migrate"], text=True,
                              capture_output=True, env=stack.env(DATABASE_URL=url),
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert "encoding is 'SQL_ASCII', not UTF8" in done.stderr, done.stderr
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
                                ).fetchone() == (0,)
    finally:
        with psycopg.connect(stack.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(name)))


def test_a_database_migrated_from_another_text_of_a_migration_is_refused(stack: Stack) -> None:
    """A migration edited after a database applied it left that database's schema behind
    the code's, silently (a column the projector writes was missing, and it retried its
    batch forever). Each migration is recorded with its text's digest: a different one is
    refused with the migration's name; one recorded before digests gets today's."""
    name = f"drift_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = psycopg.conninfo.make_conninfo(stack.database_url, dbname=name)
        assert migrate(url)  # every migration, each with its digest
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE schema_migrations SET digest = NULL"
                         " WHERE version = '001_conversations'")
            conn.execute("UPDATE schema_migrations SET digest = 'edited'"
                         " WHERE version = '010_data_keys'")
        done = subprocess.run([sys.executable, "-m", "launch", "migrate"], text=True,
                              capture_output=True, env=stack.env(DATABASE_URL=url),
                              timeout=120)
        assert done.returncode == 2, done.stderr
        assert "migration 010_data_keys was applied" in done.stderr, done.stderr
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT digest FROM schema_migrations"
                               " WHERE version = '001_conversations'").fetchone()
            assert row is not None and row[0] and len(row[0]) == 64  # filled in
    finally:
        with psycopg.connect(stack.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def relay(port: int, to: tuple[str, int]) -> socket.socket:
    """Listens on ``port`` and pipes each connection to ``to``, until closed."""
    server = socket.create_server(("127.0.0.1", port))

    def pipe(a: socket.socket, b: socket.socket) -> None:
        """One direction, until its end; then ``b`` is told no more comes (a half-close):
        the sockets are closed once both directions have ended, never under the other."""
        with contextlib.suppress(OSError):  # reset by a peer
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def connection(client: socket.socket, upstream: socket.socket) -> None:
        back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        back.start()
        with client, upstream:
            pipe(client, upstream)
            back.join()

    def serve() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(to)
            threading.Thread(target=connection, args=(client, upstream), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_setup_step_waits_for_a_database_that_answers_late(stack: Stack) -> None:
    """Compose starts its setup step beside PostgreSQL and Kafka: a setup that gave up on
    a server still starting (10 s for Kafka) left a stack whose services waited forever
    for topics. ``--wait`` tries again, saying so, until the server answers."""
    name = f"late_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    real = psycopg.conninfo.conninfo_to_dict(stack.database_url)
    port = free_port()  # nothing listens there yet
    url = psycopg.conninfo.make_conninfo(stack.database_url, dbname=name, host="127.0.0.1",
                                         port=str(port))
    setup = subprocess.Popen([sys.executable, "-m", "launch", "migrate", "--wait", "120"],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=stack.env(DATABASE_URL=url))
    server = None
    try:
        assert setup.stderr is not None
        said = setup.stderr.readline()
        assert "PostgreSQL does not answer" in said and "trying again for" in said, said
        server = relay(port, (str(real.get("host", "127.0.0.1")), int(real["port"])))
        out, err = setup.communicate(timeout=120)
        assert setup.returncode == 0, err
        assert out.startswith("applied: 001_conversations"), out
    finally:
        setup.kill()
        if server is not None:
            server.close()
        with psycopg.connect(stack.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_a_projector_whose_consumer_closes_waits_no_more_for_the_database() -> None:
    """Partitions assigned while the database is away wait for it (their positions are
    stored with the rows), but not once the projector stops: a worker's takeover that
    retried so on a consumer being closed kept its process from exiting."""
    from prometheus_client import CollectorRegistry

    from projections.projector import Projector

    away = f"postgresql://postgres@127.0.0.1:{free_port()}/nothing"  # nothing listens
    projector = Projector(ProjectorSettings(), "127.0.0.1:1", away, CollectorRegistry())
    closing = iter([False, True])
    started = time.monotonic()
    try:
        assert projector._on_assign([(PROMPTS, 0)], lambda: next(closing)) is None
    finally:
        projector._producer.close()
    assert time.monotonic() - started < 10


def test_a_refused_batch_is_taken_again_until_it_passes_and_stop_ends_the_wait() -> None:
    """The step every consumer that writes to PostgreSQL takes a batch with: tried again
    after each refusal the caller names (told of each, with its delay), its result once
    it passes; any other error at once; and a wait cut short by stop."""
    import asyncio

    from pipeline.projecting import Stopped, until_taken
    from pipeline.retry import Backoff

    told: list[tuple[str, float]] = []

    async def retrying(exc: BaseException, delay: float) -> None:
        told.append((str(exc), delay))

    async def run() -> None:
        tries = iter([ConnectionError("away"), ConnectionError("still away"), "stored"])

        async def step() -> str:
            outcome = next(tries)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        backoff = Backoff(0.01, 0.02)
        assert await until_taken(step, (ConnectionError,), retrying, backoff) == "stored"
        assert [why for why, _ in told] == ["away", "still away"]
        assert 0.008 <= told[0][1] <= 0.012 and 0.016 <= told[1][1] <= 0.024  # doubling

        async def broken() -> str:
            raise ValueError("the event's own fault")

        with pytest.raises(ValueError):
            await until_taken(broken, (ConnectionError,), retrying, backoff)

        async def refused() -> str:
            raise ConnectionError("down for good")

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        with pytest.raises(Stopped):
            await until_taken(refused, (ConnectionError,), retrying, Backoff(60, 60), stop)
        assert time.monotonic() - started < 5  # not the minute's backoff

        # A step that never ends (a key asked for again while Kafka is away) is cancelled
        # its grace after stop: a projector so stuck ignored SIGTERM for minutes.
        cancelled = asyncio.Event()

        async def stuck() -> str:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()
            return "never"

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        with pytest.raises(Stopped):
            await until_taken(stuck, (ConnectionError,), retrying, Backoff(60, 60), stop,
                              grace_s=0.3)
        assert cancelled.is_set() and 0.4 < time.monotonic() - started < 5

        async def ending() -> str:  # a batch being applied when stop came ends in its grace
            await asyncio.sleep(0.3)
            return "stored"

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stop.set)
        assert await until_taken(ending, (ConnectionError,), retrying, Backoff(60, 60), stop,
                                 grace_s=2) == "stored"

    asyncio.run(run())
