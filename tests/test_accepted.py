"""Accepted means served: the holes a black-box fault run found, each held shut against
real Kafka and PostgreSQL. The worker is the SIMULATED engine (token i is "t{i} "),
serving a model name of this module's own, so no other module's leftovers reach it.

1. Client strings that reach the store are bounded; an event the store refuses for its
   content is dead-lettered and the projector goes on.
2. Every text field follows one rule; every request the gateway accepts is stored.
3. Hostile JSON is a 400.
4. Concurrent appends to one session: one turn counts, the others get 409.
5. Control events reach a full worker; cancelled and abandoned queued turns never start.
7. Events from a newer producer are served, stored and audited.
8. Host allow-list and JSON-only bodies.
(6, a paused worker fenced, runs with vLLM in test_workers.py.)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.postgres import PostgresServer
from infra.process import free_port
from pipeline.codec import CLEAR
from pipeline.topics import CONTROL, DEADLETTER, GENERATIONS, PROMPTS
from projections.migrate import migrate
from projections.projector import caused_by_event
from schemas import (
    ChatMessage,
    ClientDetached,
    GenerationCancelled,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SessionCreated,
)
from tests.conftest import Pipeline, Service, Stack, start_service, wait_healthy
from tests.logread import end_offsets, read_events, read_records
from tests.replaying import differences
from tests.sse import scrape
from workers.sim_engine import sim_token_text

pytestmark = pytest.mark.integration

MODEL = "sim-accepted"
SEQS = 4  # the worker's max_num_seqs: easy to fill
RATE = 20  # simulated tokens/s per sequence
GRACE_S = 1


def expected(tokens: int) -> str:
    return "".join(sim_token_text(i) for i in range(tokens))


@dataclass
class Accepting(Pipeline):
    second: str = ""
    worker_url: str = ""

    def chat(self, content: str, tokens: int = 3, **extra: object) -> dict:
        return {"model": MODEL, "max_tokens": tokens,
                "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="module")
def acc(sim_stack: Stack) -> Iterator[Accepting]:
    ports, metrics = (free_port(), free_port()), free_port()
    gateway_env = {"GATEWAY_MODELS": MODEL, "GATEWAY_CANCEL_GRACE_S": str(GRACE_S)}
    services = {
        "projector": start_service(sim_stack, "acc-projector", "projector"),
        "worker": start_service(sim_stack, "acc-worker", "worker", "--engine", "sim",
                                "--max-num-seqs", str(SEQS), "--metrics-port", str(metrics),
                                WORKER_SERVED_MODEL_NAME=MODEL,
                                WORKER_SIM_TOKENS_PER_S=str(RATE)),
        "gateway-1": start_service(sim_stack, "acc-gateway-1", "gateway", "--port",
                                   str(ports[0]), **gateway_env),
        "gateway-2": start_service(sim_stack, "acc-gateway-2", "gateway", "--port",
                                   str(ports[1]), **gateway_env),
    }
    a = Accepting(sim_stack, f"http://127.0.0.1:{ports[0]}", services,
                  second=f"http://127.0.0.1:{ports[1]}",
                  worker_url=f"http://127.0.0.1:{metrics}/metrics")
    try:
        for url in (a.url, a.second):
            wait_healthy(url, list(services.values()), timeout=60)
        warm = httpx.post(f"{a.url}/v1/chat/completions", json=a.chat("warm", 2), timeout=60)
        assert warm.status_code == 200, warm.text + a.logs()
        yield a
    finally:
        for s in services.values():
            s.stop()


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random",
                         "enable.idempotence": True})
    producer.produce(topic, key=key, value=value)
    assert producer.flush(10) == 0


def history(url: str, session: str) -> list[tuple[str, str]]:
    r = httpx.get(f"{url}/v1/sessions/{session}/messages", timeout=30)
    assert r.status_code == 200, r.text
    return [(m["role"], m["content"]) for m in r.json()["data"]]


def stored(database_url: str, session: str) -> list[tuple[str, str]]:
    with psycopg.connect(database_url) as conn:
        return [tuple(row) for row in conn.execute(  # type: ignore[misc]
            "SELECT role, content FROM messages WHERE conversation_id = %s ORDER BY seq",
            (session,))]


# -- 1. bounded client strings; the projector never dies on one event ------------------
def test_a_long_idempotency_key_is_a_400_and_writes_nothing(acc: Accepting) -> None:
    before = end_offsets(acc.stack.bootstrap, PROMPTS)
    r = httpx.post(f"{acc.url}/v1/chat/completions", json=acc.chat("k"), timeout=30,
                   headers={"Idempotency-Key": "k" * 3500})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_idempotency_key"
    assert end_offsets(acc.stack.bootstrap, PROMPTS) == before


def test_events_that_break_the_stores_constraints_are_dead_lettered(acc: Accepting) -> None:
    """Written straight into the topics, as another producer (or an older gateway) could:
    each is parked with its reason, nothing of it is half-stored, and the projection goes
    on. The event that stopped the projector before (a 3,500-character idempotency key,
    once indexed) is simply stored."""
    owner = httpx.post(f"{acc.url}/v1/sessions", json={"title": "owner"}, timeout=30).json()
    session = uuid.UUID(owner["id"])
    bad = {
        # integrity (23503): a turn put into another tenant's conversation
        "other tenant": (PROMPTS, PromptSubmitted(
            conversation_id=session, request_id=f"cross-{uuid.uuid4().hex}", tenant="mallory",
            model="none", messages=(ChatMessage(role="user", content="intrude"),))),
        # data (22003): a number past the column's range
        "out of range": (GENERATIONS, GenerationStarted(
            conversation_id=uuid.uuid4(), request_id=f"range-{uuid.uuid4().hex}", model=MODEL,
            worker="elsewhere", reply_seq=1, prompt_tokens=2**40)),
    }
    long_key = PromptSubmitted(
        conversation_id=uuid.uuid4(), request_id=f"longkey-{uuid.uuid4().hex}", model="none",
        messages=(ChatMessage(role="user", content="kept"),), idempotency_key="k" * 3500)
    nul = SessionCreated(conversation_id=uuid.uuid4(), request_id=f"nul-{uuid.uuid4().hex}",
                         title="nul\x00title")
    # Encoded once: content is sealed with a fresh nonce at each encoding.
    written = {name: CLEAR.encode(event) for name, (_, event) in bad.items()}
    for name, (topic, event) in bad.items():
        produce(acc.stack.bootstrap, topic, str(event.conversation_id).encode(), written[name])
    for topic, event in ((PROMPTS, long_key), (CONTROL, nul)):
        produce(acc.stack.bootstrap, topic, str(event.conversation_id).encode(),
                CLEAR.encode(event))
    after = httpx.post(f"{acc.url}/v1/chat/completions", json=acc.chat("still here?"),
                       timeout=60)
    assert after.status_code == 200, after.text
    acc.wait_projected()
    assert acc.services["projector"].proc.poll() is None, acc.services["projector"].tail()
    parked = {value: h["reason"].decode() for _, value, h in
              read_records(acc.stack.bootstrap, DEADLETTER) if h.get("consumer") == b"projector"}
    for name, value in written.items():
        assert value in parked, name
        assert "rejected by the store" in parked[value], parked[value]
    with psycopg.connect(acc.stack.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM generations WHERE request_id = ANY(%s)",
                            ([e.request_id for _, e in bad.values()],)).fetchone() == (0,)
        assert conn.execute("SELECT tenant FROM conversations WHERE id = %s",
                            (session,)).fetchone() == ("default",)
        assert conn.execute("SELECT length(idempotency_key) FROM generations"
                            " WHERE request_id = %s", (long_key.request_id,)).fetchone() == (3500,)
        assert conn.execute("SELECT title FROM conversations WHERE id = %s",
                            (nul.conversation_id,)).fetchone() == ("nul\ufffdtitle",)
    assert history(acc.url, after.headers["x-session-id"])[1][0] == "assistant"


def test_only_errors_about_an_events_content_are_the_events_fault(acc: Accepting) -> None:
    """The projector's rule, against errors PostgreSQL really raises: data (22),
    integrity (23) and program limits (54, a btree row too large) are the event's;
    anything else (a missing table, a lost connection) is retried, never dead-lettered."""
    errors = {}
    with psycopg.connect(acc.stack.database_url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE scratch (k text PRIMARY KEY, n integer CHECK (n > 0))")
        for name, sql, params in (
            ("data", "INSERT INTO scratch VALUES ('a', %s)", (2**40,)),
            ("integrity", "INSERT INTO scratch VALUES ('b', -1)", ()),
            ("limit", "INSERT INTO scratch VALUES (%s, 1)",  # incompressible, past a btree row
             (base64.b64encode(os.urandom(6000)).decode(),)),
            ("nul", "INSERT INTO scratch VALUES (%s, 1)", ("a\x00",)),
            ("missing table", "SELECT * FROM no_such_table", ()),
        ):
            try:
                conn.execute(sql, params)
            except psycopg.Error as exc:
                errors[name] = exc
    assert {name: caused_by_event(exc) for name, exc in errors.items()} == {
        "data": True, "integrity": True, "limit": True, "nul": True, "missing table": False}
    assert (errors["limit"].sqlstate or "").startswith("54")
    down = psycopg.OperationalError("connection lost")
    assert not caused_by_event(down)


def test_the_projector_waits_out_a_database_restart(acc: Accepting, tmp_path: Path) -> None:
    """A projector on a PostgreSQL of its own, stopped for a few seconds while turns go on
    and started again: the projector never exits, and its store catches up by itself to
    equal a replay of the log."""
    pg_home = Path(tempfile.mkdtemp(prefix="pipeline-test-pg-own-"))
    own = PostgresServer(home=pg_home, port=free_port(), database="own")
    own.start()
    migrate(own.url)
    stack = Stack(acc.stack.bootstrap, own.url, acc.stack.logs)
    metrics = free_port()
    projector = start_service(stack, "acc-projector-own", "projector",
                              PROJECTOR_GROUP=f"own-{uuid.uuid4().hex[:8]}",
                              PROJECTOR_METRICS_PORT=str(metrics))
    try:
        own_pipeline = Pipeline(stack, acc.url, {"projector": projector})
        own_pipeline.wait_projected(timeout=120)
        own.stop()
        sessions = [httpx.post(f"{acc.url}/v1/chat/completions", json=acc.chat(f"down {i}"),
                               timeout=60).headers["x-session-id"] for i in range(3)]
        wait_for(lambda: scrape(f"http://127.0.0.1:{metrics}/metrics").get(
            "projector_retries_total", 0) >= 2, 30, "the projector to meet the missing database")
        assert projector.proc.poll() is None, projector.tail()
        own.start()
        own_pipeline.wait_projected(timeout=60)
        assert projector.proc.poll() is None, projector.tail()
        retries = scrape(f"http://127.0.0.1:{metrics}/metrics")["projector_retries_total"]
        assert retries >= 1
        for i, session in enumerate(sessions):
            assert stored(own.url, session) == [("user", f"down {i}"), ("assistant", expected(3))]
        assert differences(stack) == {}
    finally:
        projector.stop()
        own.stop()
        shutil.rmtree(pg_home, ignore_errors=True)


# -- 2. one rule for every text field; accepted means stored ---------------------------
@pytest.mark.parametrize("body", [
    {"stop": ["a\u0000"]}, {"stop": "\u0000"}, {"user": "x\u0000"},
    {"metadata": {"k": "v\u0000"}},
    {"messages": [{"role": "user", "content": "x", "name": "n\u0000"}]},
])
def test_nul_anywhere_in_a_request_is_a_400(acc: Accepting, body: dict) -> None:
    before = end_offsets(acc.stack.bootstrap, PROMPTS)
    r = httpx.post(f"{acc.url}/v1/chat/completions", json={**acc.chat("x"), **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_value"
    assert end_offsets(acc.stack.bootstrap, PROMPTS) == before
    titled = httpx.post(f"{acc.url}/v1/sessions", json={"title": "t\u0000"}, timeout=30)
    assert titled.status_code == 400


unicode_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)


@settings(max_examples=25, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(title=st.one_of(st.none(), unicode_text), first=unicode_text, second=unicode_text,
       stop=st.one_of(st.none(), st.lists(unicode_text, max_size=4)),
       temperature=st.one_of(st.none(), st.floats(0, 2)), via_second=st.booleans())
def test_every_accepted_request_is_in_the_stored_history(
    acc: Accepting, title: str | None, first: str, second: str, stop: list[str] | None,
    temperature: float | None, via_second: bool,
) -> None:
    created = httpx.post(f"{acc.url}/v1/sessions", json={"title": title}, timeout=30)
    if created.status_code != 201:
        assert created.status_code == 400 and "\x00" in (title or ""), created.text
        return
    session = created.json()["id"]
    sent = []
    for content, url in ((first, acc.url), (second, acc.second if via_second else acc.url)):
        r = httpx.post(f"{url}/v1/sessions/{session}/messages", timeout=60, json={
            "content": content, "stop": stop, "temperature": temperature, "max_tokens": 2})
        assert r.status_code < 500, r.text
        if r.status_code == 200:
            sent.append((content, r.json()["choices"][0]["message"]["content"]))
        else:
            assert r.status_code == 400 and "error" in r.json(), r.text
            assert "\x00" in content or any("\x00" in s for s in stop or ()), r.text
    expected_history = [m for c, reply in sent for m in (("user", c), ("assistant", reply))]
    assert history(acc.url, session) == expected_history
    acc.wait_projected()
    assert stored(acc.stack.database_url, session) == expected_history


# -- 3. hostile JSON -------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    b'{"model": "sim-accepted", "seed": ' + b"9" * 5000 + b', "messages": []}',
    b'{"model": "sim-accepted", "seed": ' + b"9" * 4000 + b', "messages": [{"role": "user",'
    b' "content": "x"}]}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "sim-accepted", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "sim-accepted", "temperature": 1' + b"0" * 400 + b', "messages": []}',
])
def test_hostile_json_is_a_400_without_a_traceback(acc: Accepting, body: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/sessions"):
        r = httpx.post(f"{acc.url}{path}", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text[:300])
        assert r.json()["error"]["message"]
    assert "Traceback" not in acc.services["gateway-1"].log.read_text(errors="replace")


# -- 4. one turn at a time per session -------------------------------------------------
def test_concurrent_appends_through_two_gateways_lose_no_accepted_turn(acc: Accepting) -> None:
    session = httpx.post(f"{acc.url}/v1/sessions", json={}, timeout=30).json()["id"]

    def append(i: int) -> httpx.Response:
        url = acc.url if i % 2 else acc.second
        return httpx.post(f"{url}/v1/sessions/{session}/messages", timeout=60,
                          json={"content": f"append {i}", "max_tokens": 4})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(append, range(8)))
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert ok, [r.text for r in answers]
    assert all(r.status_code == 409 for r in refused), [r.text for r in refused]
    winners = {r.json()["id"] for r in ok}
    for r in refused:  # each refusal names a turn that counts
        assert r.json()["error"]["code"] == "turn_in_progress"
        assert any(w in r.json()["error"]["message"] for w in winners), r.text
    contents = {json.loads(r.request.content)["content"] for r in ok}
    turns = [(m, reply) for m, reply in zip(*[iter(history(acc.url, session))] * 2,
                                            strict=True)]
    assert {m[1] for m, _ in turns} == contents  # every 2xx turn, and only those
    assert all(reply == ("assistant", expected(4)) for _, reply in turns)
    acc.wait_projected()
    assert stored(acc.stack.database_url, session) == history(acc.url, session)
    # The void prompts are in the log, but no worker ever ran them.
    prompts = [e for _, e in read_events(acc.stack.bootstrap, PROMPTS)
               if isinstance(e, PromptSubmitted) and str(e.conversation_id) == session]
    started = {e.request_id for _, e in read_events(acc.stack.bootstrap, GENERATIONS)
               if isinstance(e, GenerationStarted) and str(e.conversation_id) == session}
    assert started == winners and len(prompts) >= len(winners)
    # The next turn, after those ended, is served on top of all of them.
    follow_up = httpx.post(f"{acc.second}/v1/sessions/{session}/messages", timeout=60,
                           json={"content": "and then", "max_tokens": 2})
    assert follow_up.status_code == 200, follow_up.text
    assert history(acc.url, session)[-2:] == [("user", "and then"), ("assistant", expected(2))]


# -- 5. control events reach a full worker ---------------------------------------------
def test_a_full_worker_hears_cancels_and_queued_turns_never_start(acc: Accepting) -> None:
    """Fill the worker's 4 slots with long background turns, then queue 36 more behind
    them: 18 whose clients hang up at once, 18 in the background. Once every grace period
    has passed, cancel all the background ones. The running turns stop within a second;
    no queued turn ever starts (its cancel, or its abandonment, was read while it waited);
    the backlog counts prompts only and new turns are served at once."""
    def running() -> float:
        return scrape(acc.worker_url).get("worker_running_sequences", 0.0)

    def open_and_leave(i: int, background: bool) -> str:
        with httpx.stream("POST", f"{acc.url}/v1/chat/completions", timeout=60,
                          json=acc.chat(f"fill {i}", 2000, stream=True,
                                        background=background)) as r:
            assert r.status_code == 200
            return r.headers["x-request-id"]

    first = [open_and_leave(i, True) for i in range(SEQS)]
    wait_for(lambda: running() == SEQS, 10, "the worker to fill up")
    with ThreadPoolExecutor(8) as pool:
        queued = list(pool.map(lambda i: open_and_leave(i, i % 2 == 0), range(SEQS, 40)))
    # Every hung-up client's grace is over (their leaving is in the log, with its time).
    def left_at() -> list[float]:
        return [e.occurred_at.timestamp() for _, e in read_events(acc.stack.bootstrap, CONTROL)
                if isinstance(e, ClientDetached) and e.request_id in queued[1::2]]
    wait_for(lambda: len(left_at()) == len(queued[1::2]), 10, "the clients' leaving")
    time.sleep(max(max(left_at()) + GRACE_S + 0.2 - time.time(), 0))
    assert running() == SEQS  # still full: nothing queued got a slot
    for rid in queued[::2] + first:  # the queued first: a slot freed would start them
        r = httpx.post(f"{acc.second}/v1/chat/completions/{rid}/cancel", timeout=30)
        assert r.status_code == 200, r.text
    wait_for(lambda: running() == 0, 5, "running turns to stop")
    served = httpx.post(f"{acc.url}/v1/chat/completions", json=acc.chat("next please"),
                        timeout=30)
    assert served.status_code == 200 and served.json()["choices"][0]["message"][
        "content"] == expected(3)
    wait_for(lambda: scrape(f"{acc.url}/metrics").get("gateway_backlog", 1) == 0, 10,
             "the backlog (prompts only) to drain")
    started = {e.request_id for _, e in read_events(acc.stack.bootstrap, GENERATIONS)
               if isinstance(e, GenerationStarted) and e.request_id in first + queued}
    assert started == set(first)  # no queued turn ever started
    acc.wait_projected()
    with psycopg.connect(acc.stack.database_url) as conn:
        statuses = dict(conn.execute("SELECT request_id, status FROM generations"
                                     " WHERE request_id = ANY(%s)",
                                     (first + queued,)).fetchall())
    assert len(statuses) == 40 and set(statuses.values()) == {"cancelled"}
    # Each running turn ended within an engine step plus a second of its cancel.
    asked = {e.request_id: e.occurred_at for _, e in read_events(acc.stack.bootstrap, CONTROL)
             if isinstance(e, GenerationCancelled) and e.request_id in first}
    ended = {e.request_id: e.occurred_at for _, e in read_events(acc.stack.bootstrap, GENERATIONS)
             if isinstance(e, GenerationFinished) and e.request_id in first}
    assert set(asked) == set(ended) == set(first)
    assert all((ended[r] - asked[r]).total_seconds() < 1 + 1 / RATE for r in first), \
        {r: (ended[r] - asked[r]).total_seconds() for r in first}


# -- 7. a newer producer's events --------------------------------------------------------
def test_an_event_with_an_unknown_field_is_served_stored_and_audited(acc: Accepting) -> None:
    conversation = uuid.uuid4()
    request_id = f"chatcmpl-{conversation.hex}{uuid.uuid4().hex[:16]}"
    newer = {"type": "PromptSubmitted", "v": 9, "conversation_id": str(conversation),
             "request_id": request_id, "tenant": "default", "model": MODEL,
             "occurred_at": "2026-11-23T12:00:00Z", "event_id": str(uuid.uuid4()),
             "messages": [{"role": "user", "content": "from the future", "lang": "en"}],
             "sampling": {"max_tokens": 3, "min_p": 0.1}, "priority": "high"}
    produce(acc.stack.bootstrap, PROMPTS, str(conversation).encode(),
            json.dumps(newer).encode())
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{acc.url}/v1/chat/completions/{request_id}", timeout=30)).json().get(
            "status") != "finished":
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.json()["choices"][0]["message"]["content"] == expected(3)
    acc.wait_projected()
    assert stored(acc.stack.database_url, str(conversation)) == [
        ("user", "from the future"), ("assistant", expected(3))]
    audit = subprocess.run([sys.executable, "-m", "launch", "audit", str(conversation),
                            "--json"], capture_output=True, text=True, env=acc.stack.env(),
                           timeout=120)
    assert audit.returncode == 0, audit.stderr
    prompt = next(e["event"] for e in map(json.loads, audit.stdout.splitlines())
                  if e["event"]["type"] == "PromptSubmitted")
    assert (prompt["priority"], prompt["v"], prompt["messages"][0]["lang"]) == ("high", 9, "en")
    parked = [v for _, v, h in read_records(acc.stack.bootstrap, DEADLETTER)
              if h.get("source.topic") == PROMPTS.encode() and str(conversation).encode() in v]
    assert parked == []


# -- 8. reachable from a web page --------------------------------------------------------
def test_foreign_hosts_and_form_posts_are_refused(acc: Accepting) -> None:
    r = httpx.get(f"{acc.url}/v1/models", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    for host in ("127.0.0.1", "localhost:1234", "[::1]:80"):
        assert httpx.get(f"{acc.url}/v1/models", headers={"Host": host}).status_code == 200
    for content_type, body in (("application/x-www-form-urlencoded", b"title=x"),
                               ("text/plain", b'{"title": "x"}'),
                               ("multipart/form-data; boundary=b", b"--b--")):
        before = end_offsets(acc.stack.bootstrap, CONTROL)
        r = httpx.post(f"{acc.url}/v1/sessions", content=body, timeout=30,
                       headers={"content-type": content_type})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert end_offsets(acc.stack.bootstrap, CONTROL) == before
    assert httpx.post(f"{acc.url}/v1/sessions", content=b'{"title": "x"}', timeout=30,
                      headers={"content-type": "application/json; charset=utf-8"}
                      ).status_code == 201
    port = free_port()
    named: Service = start_service(acc.stack, "acc-gateway-named", "gateway", "--port",
                                   str(port), GATEWAY_ALLOWED_HOSTS="chat.example.com, *.corp")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [named], timeout=60)
        for host, status in (("chat.example.com", 200), ("a.corp", 200),
                             ("evil.example", 400)):
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Host": host})
            assert r.status_code == status, (host, r.text)
    finally:
        named.stop()
