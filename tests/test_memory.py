"""Long-term memory, end to end on the vLLM stack: the memory service (``pipeline
memory``) embedding with vLLM's pooling runner and the tiny local model, memories in
PostgreSQL with pgvector, and a gateway that recalls from it.

The tiny model's vectors rank by nothing, so these tests give each user few memories
(all within the recall's k): what they check is what reaches the model, who may see
what, and how a memory is forgotten, not the ranking.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from infra.process import free_port
from memory import store
from memory.embedder import Turns
from pipeline.digests import Digester
from pipeline.kek import load_kek
from pipeline.settings import CommonSettings
from pipeline.topics import CONTROL, PROMPTS
from schemas import MemoryForgotten, PromptSubmitted
from schemas.history import RECALL_PREAMBLE
from tests.conftest import (
    MODEL,
    Pipeline,
    Service,
    Stack,
    at_once,
    new_database,
    start_service,
    wait_healthy,
)
from tests.logread import read_events, read_records
from tests.replaying import cli

MEMORY_START_S = 600  # vLLM's engine on a loaded CI host


@dataclass
class Memory:
    pipeline: Pipeline
    url: str  # the gateway that recalls
    service_url: str  # the memory service itself
    services: dict[str, Service]

    def logs(self) -> str:
        return "\n".join(s.tail() for s in self.services.values())


def wait_up(url: str, service: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert service.proc.poll() is None, service.tail()
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, service.tail()
        time.sleep(0.5)


def start_memory(pipeline: Pipeline, name: str, *args: str,
                 port: int | None = None) -> tuple[Service, str]:
    port = port or free_port()
    service = start_service(pipeline.stack, name, "memory", "--port", str(port), *args)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, service, MEMORY_START_S)
    return service, url


@pytest.fixture(scope="module")
def mem(pipeline: Pipeline) -> Iterator[Memory]:
    services: dict[str, Service] = {}
    try:
        services["memory"], service_url = start_memory(pipeline, "memory")
        port = free_port()
        services["gateway"] = start_service(
            pipeline.stack, "memory-gateway", "gateway", "--port", str(port),
            GATEWAY_MEMORY_URL=service_url)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, list(services.values()), timeout=60)
        yield Memory(pipeline, url, service_url, services)
    finally:
        for service in services.values():
            service.stop()


def turn(url: str, content: str, user: str | None, memory: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "memory": memory,
                            "messages": [{"role": "user", "content": content}]}
    if user is not None:
        body["user"] = user
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return {**reply, "session_id": r.headers["x-session-id"]}


def memories(url: str, user: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/memories", params={"user": user}, timeout=30)
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["data"]
    return found


def remembered(url: str, user: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
    """The user's memories once there are ``count`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        found = memories(url, user)
        if len(found) == count:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.3)


def prompt_of(mem: Memory, request_id: str) -> PromptSubmitted:
    found = [e for _, e in read_events(mem.pipeline.stack.bootstrap, PROMPTS)
             if isinstance(e, PromptSubmitted) and e.request_id == request_id]
    assert len(found) == 1, request_id
    return found[0]


def user_name() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def test_a_recall_waiting_for_the_engine_goes_before_the_consumers_next_chunk() -> None:
    """The engine's turns (``memory.embedder.Turns``), with threads standing for the
    consumer's chunks and a recall: while the consumer's first chunk holds the engine
    and its next two wait, a recall that comes is next."""
    turns, order = Turns(), []
    holding, release = threading.Event(), threading.Event()

    def call(name: str, urgent: bool) -> None:
        with turns.hold(urgent):
            order.append(name)
            if name == "chunk 1":
                holding.set()
                assert release.wait(10)

    def start(name: str, urgent: bool = False) -> threading.Thread:
        thread = threading.Thread(target=call, args=(name, urgent))
        thread.start()
        return thread

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    threads = [start("chunk 1")]
    assert holding.wait(10)
    threads += [start("chunk 2"), start("chunk 3")]
    until(lambda: turns.waiting == 2)
    threads.append(start("recall", urgent=True))
    until(lambda: turns.waiting == 3)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order[:2] == ["chunk 1", "recall"] and sorted(order[2:]) == ["chunk 2", "chunk 3"]


def test_a_user_keeps_their_newest_memories_whatever_order_they_come_in(stack: Stack
                                                                         ) -> None:
    """``memory.store`` on PostgreSQL with pgvector: past ``keep`` a user's oldest
    memories are dropped, another user's are not, and a store that gets the same
    memories in the opposite order (a rebuild reading partitions otherwise) keeps the
    same ones."""
    base = datetime(2026, 11, 27, tzinfo=UTC)
    told = [store.Remembered("t", "u", f"turn-{i}", uuid.uuid4(), f"fact {i}",
                             base + timedelta(minutes=i)) for i in range(6)]
    other = store.Remembered("t", "v", "turn-v", uuid.uuid4(), "another user's",
                             base - timedelta(days=1))

    async def fill(url: str, items: list[store.Remembered]) -> set[str]:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            for item in items:  # one at a time, as batches come
                await store.remember(conn, [(item, [1.0, 0.0, float(len(item.id))])], "m")
                await store.evict(conn, [(item.tenant, item.user)], keep=3)
            cur = await conn.execute("SELECT id FROM memories")
            return {row[0] for row in await cur.fetchall()}

    kept = []
    for name, items in (("forward", [other, *told]), ("backward", [*reversed(told), other])):
        url = new_database(stack.database_url, f"memory_evict_{name}_{uuid.uuid4().hex[:6]}")
        store.migrate(url)
        kept.append(asyncio.run(fill(url, items)))
    assert kept[0] == kept[1] == {"turn-3", "turn-4", "turn-5", "turn-v"}


def test_services_starting_at_once_make_their_schema_once(stack: Stack) -> None:
    """Memory services (and analytics, a replay) that start together each make their
    tables and schema if missing: PostgreSQL's ``CREATE ... IF NOT EXISTS`` of one object
    by two sessions at once fails in one (38 of 60 memory services, three at a time, did),
    so each takes the lock of schema changes first (``pipeline.pgschema``)."""
    from projections.migrate import migrate

    for _ in range(4):
        schema = f"at_once_{uuid.uuid4().hex[:8]}"
        assert at_once(lambda s=schema: migrate(stack.database_url, schema=s), 3) == []
        url = new_database(stack.database_url, f"memory_at_once_{uuid.uuid4().hex[:8]}")
        assert at_once(lambda u=url: store.migrate(u), 3) == []


def test_a_fact_told_in_one_session_is_given_to_the_model_in_the_next(mem: Memory) -> None:
    alice, fact = user_name(), f"My dog is called Rex-{uuid.uuid4().hex[:6]}."
    first = turn(mem.url, fact, alice)
    [memory] = remembered(mem.url, alice, 1)
    assert memory["text"] == fact and memory["id"] == first["id"]
    assert memory["session_id"] == first["session_id"]

    question = "What is my dog called?"
    second = turn(mem.url, question, alice)
    assert second["session_id"] != first["session_id"]  # a new session
    prompt = prompt_of(mem, second["id"])
    # What the model was given is in the log, for an auditor: the fact, by its turn.
    assert [(r.id, r.text) for r in prompt.recalled] == [(first["id"], fact)]
    assert prompt.memory and prompt.user == alice
    # ... and it was given it: the same question without memory reads fewer tokens,
    # the difference being the recalled memory's message.
    plain = turn(mem.url, question, alice, memory=False)
    assert prompt_of(mem, plain["id"]).recalled == ()
    assert second["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 5
    # A turn without memory is not remembered.
    assert len(remembered(mem.url, alice, 2)) == 2  # the question, not the plain turn
    # In the log the recalled text is sealed like the messages: no raw record holds it.
    raw = b"".join(value or b"" for _, value, _ in
                   read_records(mem.pipeline.stack.bootstrap, PROMPTS))
    assert fact.encode() not in raw and RECALL_PREAMBLE.encode() not in raw


def test_no_user_and_no_tenant_recalls_another_users_memory(mem: Memory) -> None:
    alice, bob, secret = user_name(), user_name(), f"my PIN is {uuid.uuid4().hex[:8]}"
    turn(mem.url, secret, alice)
    remembered(mem.url, alice, 1)
    # Another user of the same tenant: nothing of alice's is listed or recalled.
    assert memories(mem.url, bob) == []
    bobs = turn(mem.url, "what is my PIN?", bob)
    assert prompt_of(mem, bobs["id"]).recalled == ()
    # Another tenant's user of the same name: the memory service answers within the
    # tenant the gateway names (the caller's), and finds nothing there.
    for tenant in ("another-tenant", "default\x00", "Default"):
        r = httpx.post(f"{mem.service_url}/v1/recall", timeout=30, json={
            "tenant": tenant, "user": alice, "text": "what is my PIN?"})
        assert r.status_code in (200, 400), r.text
        assert r.status_code == 400 or r.json()["memories"] == []
    same = httpx.post(f"{mem.service_url}/v1/recall", timeout=30, json={
        "tenant": "default", "user": alice, "text": "what is my PIN?"}).json()
    assert [m["text"] for m in same["memories"]] == [secret]


def test_a_forgotten_memory_is_never_recalled_again_even_from_the_log(mem: Memory) -> None:
    carol = user_name()
    kept = turn(mem.url, "I live in Lyon.", carol)
    gone = turn(mem.url, "I was born in 1980.", carol)
    remembered(mem.url, carol, 2)
    r = httpx.delete(f"{mem.url}/v1/memories/{gone['id']}", params={"user": carol},
                     timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert [m["id"] for m in memories(mem.url, carol)] == [kept["id"]]
    again = turn(mem.url, "When was I born?", carol)
    assert [r.id for r in prompt_of(mem, again["id"]).recalled] == [kept["id"]]
    # The forgetting is in the log, so a store rebuilt from it forgets it too.
    # It names carol by digest only.
    digest = Digester(load_kek(CommonSettings())).digest("user", "default", carol)
    forgotten = [e for _, e in read_events(mem.pipeline.stack.bootstrap, CONTROL)
                 if isinstance(e, MemoryForgotten) and e.user == digest]
    assert [e.request_id for e in forgotten] == [gone["id"]]
    # Unknown, or another user's: 404, and nothing is written.
    for memory_id, user in (("chatcmpl-nope", carol), (kept["id"], user_name())):
        r = httpx.delete(f"{mem.url}/v1/memories/{memory_id}", params={"user": user},
                         timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "memory_not_found"
    # All of a user's memories at once.
    r = httpx.delete(f"{mem.url}/v1/memories", params={"user": carol}, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] == 2, r.text  # Lyon, and the question
    assert memories(mem.url, carol) == []


def test_a_deleted_session_takes_its_memories_with_it(mem: Memory) -> None:
    dave = user_name()
    told = turn(mem.url, "My favourite colour is green.", dave)
    remembered(mem.url, dave, 1)
    r = httpx.delete(f"{mem.url}/v1/sessions/{told['session_id']}", timeout=30)
    assert r.status_code == 200, r.text
    remembered(mem.url, dave, 0)


def test_a_rebuilt_memory_store_equals_the_live_one(mem: Memory) -> None:
    """A second memory service in a group and schema of its own reads the log from its
    start: its memories are the live store's, forgotten and deleted ones included."""
    users = [user_name(), user_name()]
    for user in users:
        turn(mem.url, f"{user} likes tea.", user)
        remembered(mem.url, user, 1)
    gone = turn(mem.url, "forget me", users[0])
    remembered(mem.url, users[0], 2)
    assert httpx.delete(f"{mem.url}/v1/memories/{gone['id']}", params={"user": users[0]},
                        timeout=30).status_code == 200
    schema = f"memory_rebuild_{uuid.uuid4().hex[:6]}"
    service, url = start_memory(mem.pipeline, "memory-rebuild", "--group", schema,
                                "--schema", schema)
    try:
        for user in users:
            want = [(m["id"], m["text"]) for m in memories(mem.url, user)]
            deadline = time.monotonic() + 120
            while True:
                r = httpx.get(f"{url}/v1/memories", timeout=30,
                              params={"tenant": "default", "user": user})
                got = [(m["id"], m["text"]) for m in r.json()["data"]]
                if got == want:
                    break
                assert time.monotonic() < deadline, (got, want)
                time.sleep(0.5)
    finally:
        service.stop()


def test_memory_refusals_are_clear(mem: Memory) -> None:
    # memory without a user
    r = httpx.post(f"{mem.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "memory": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
    # listing without a user, a user past its limits
    for params in ({}, {"user": ""}, {"user": "x" * 201}, {"user": "a\x00b"}):
        r = httpx.get(f"{mem.url}/v1/memories", params=params, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
    # memory asked of a gateway that has none
    r = httpx.post(f"{mem.pipeline.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "memory": True, "user": "u",
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "memory_not_enabled", r.text
    r = httpx.get(f"{mem.pipeline.url}/v1/memories", params={"user": "u"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "memory_not_enabled", r.text
    # hostile bodies at the memory service itself
    for body in ([], {"tenant": "t"}, {"tenant": "t", "user": "u", "text": 5},
                 {"tenant": "t", "user": "u", "text": "x", "k": -1},
                 {"tenant": "t", "user": "u", "text": "x", "exclude_session": "nope"}):
        r = httpx.post(f"{mem.service_url}/v1/recall", json=body, timeout=30)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    r = httpx.post(f"{mem.service_url}/v1/recall", content=b"{", timeout=30)
    assert r.status_code == 400, r.text


def test_one_tenants_recalls_at_once_neither_hold_back_nor_crowd_out_another(
        mem: Memory) -> None:
    """Alpha sends 200 recalls at once, then beta one. Beta's is answered within two
    batches, not behind alpha's 200 (which each took the engine in turn); each of
    alpha's is answered, or refused with 429 naming the cap once 32 of alpha's wait
    (8 run at once)."""
    url = f"{mem.service_url}/v1/recall"

    async def recall(client: httpx.AsyncClient, tenant: str, i: int) -> tuple[int, float]:
        began = time.monotonic()
        r = await client.post(url, json={"tenant": tenant, "user": "u", "text": f"q {i}"})
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "tenant_recalls_cap", r.text
            assert "MEMORY_MAX_WAITING_RECALLS_PER_TENANT" in r.text
        return r.status_code, time.monotonic() - began

    def beta_recall() -> tuple[int, float, float]:
        """Beta's, from a client of its own: its status, its time, and the service's."""
        began = time.monotonic()
        r = httpx.post(url, json={"tenant": "beta", "user": "u", "text": "q"}, timeout=60)
        return r.status_code, time.monotonic() - began, r.json().get("ms", 0.0) / 1000

    async def scenario() -> tuple[list[tuple[int, float]], tuple[int, float, float], float]:
        alone = min(beta_recall()[1] for _ in range(5))
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(
                max_connections=300)) as client:
            flood = [asyncio.create_task(recall(client, "alpha", i)) for i in range(200)]
            await asyncio.sleep(0.2)
            beta = await asyncio.to_thread(beta_recall)
            return await asyncio.gather(*flood), beta, alone

    alpha, (status, beta_s, served_s), alone_s = asyncio.run(scenario())
    statuses = [s for s, _ in alpha]
    assert status == 200 and set(statuses) == {200, 429}, set(statuses)
    # 32 waiting and the places running, at least: 8, or 7 once beta's (which may come
    # while alpha's still arrive, on a busy host) holds one (CI once counted 39).
    assert statuses.count(200) >= 39
    print({"beta_alone_s": alone_s, "beta_beside_s": beta_s, "beta_in_service_s": served_s,
           "alpha_answered": statuses.count(200)})
    assert beta_s < max(10 * alone_s, 1.0), (alone_s, beta_s)


def test_a_turn_that_cannot_recall_is_refused_and_not_written(mem: Memory) -> None:
    port = free_port()
    away = start_service(mem.pipeline.stack, "memory-away-gateway", "gateway", "--port",
                         str(port), GATEWAY_MEMORY_URL=f"http://127.0.0.1:{free_port()}",
                         GATEWAY_MEMORY_TIMEOUT_S="2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [away], timeout=60)
        content = f"never written {uuid.uuid4().hex}"
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "memory": True, "user": "u",
            "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "memory_unavailable"
        assert r.headers["retry-after"]
        assert not [e for _, e in read_events(mem.pipeline.stack.bootstrap, PROMPTS)
                    if isinstance(e, PromptSubmitted)
                    and e.messages[-1].content == content]
        r = httpx.get(f"{url}/v1/memories", params={"user": "u"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "memory_unavailable"
    finally:
        away.stop()


def test_a_turn_whose_recall_outlasts_the_acceptance_bound_is_refused_in_it(
        mem: Memory) -> None:
    """Every step before a turn's commit is held to GATEWAY_ACCEPT_TIMEOUT_S, whatever
    bound the service it waits on has: a memory service that takes connections and never
    answers (its client would wait 60 s) gets the turn refused once the 2 s are up, with
    its id, and it is never written."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers
        port = free_port()
        slow = start_service(
            mem.pipeline.stack, "memory-silent-gateway", "gateway", "--port", str(port),
            GATEWAY_MEMORY_URL=f"http://127.0.0.1:{silent.getsockname()[1]}",
            GATEWAY_MEMORY_TIMEOUT_S="60", GATEWAY_ACCEPT_TIMEOUT_S="2")
        try:
            wait_healthy(f"http://127.0.0.1:{port}", [slow], timeout=60)
            content = f"never written {uuid.uuid4().hex}"
            started = time.monotonic()
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "memory": True, "user": "u",
                "messages": [{"role": "user", "content": content}]})
            took = time.monotonic() - started
        finally:
            slow.stop()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "accept_timeout"
    assert r.headers["retry-after"] and r.headers["x-request-id"].startswith("chatcmpl-")
    assert 2 <= took < 2 + 3, took
    assert not [e for _, e in read_events(mem.pipeline.stack.bootstrap, PROMPTS)
                if isinstance(e, PromptSubmitted) and e.messages[-1].content == content]


def test_a_session_created_with_memory_recalls_and_remembers_for_its_user(mem: Memory) -> None:
    erin = user_name()
    told = turn(mem.url, "I play the cello.", erin)  # in a session of its own
    remembered(mem.url, erin, 1)
    r = httpx.post(f"{mem.url}/v1/sessions", json={"memory": True, "user": erin}, timeout=30)
    assert r.status_code == 201 and r.json()["memory"] == {"user": erin}, r.text
    session = r.json()["id"]

    def append(**fields: Any) -> PromptSubmitted:
        r = httpx.post(f"{mem.url}/v1/sessions/{session}/messages", timeout=120,
                       json={"content": "What do I play?", "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text
        return prompt_of(mem, r.json()["id"])

    # Its turns say nothing of memory: they have it, for the session's user.
    asked = append()
    assert asked.memory and asked.user == erin
    assert [m.id for m in asked.recalled] == [told["id"]]
    remembered(mem.url, erin, 2)
    # A turn may say otherwise.
    assert not (plain := append(memory=False)).memory and plain.recalled == ()
    # Memory for a session needs its user.
    r = httpx.post(f"{mem.url}/v1/sessions", json={"memory": True}, timeout=30)
    assert r.status_code == 400, r.text


def refused(url: str, user: str) -> httpx.Response:
    """A memory turn that the gateway refuses, since it cannot recall."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "memory": True, "user": user, "max_tokens": 2,
        "messages": [{"role": "user", "content": f"refused {uuid.uuid4().hex}"}]})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "memory_unavailable" and r.headers["retry-after"]
    return r


def test_a_paused_memory_service_refuses_memory_turns_in_bounded_time_and_no_other(
        mem: Memory) -> None:
    """SIGSTOP the memory service (and its engine): a memory turn is refused once the
    gateway's memory timeout (5 s) is past, a turn without memory is served as ever, and
    once it runs again, so does memory, with what it was told before."""
    gina = user_name()
    told = turn(mem.url, "I live in Lyon.", gina)
    service = mem.services["memory"]
    os.killpg(service.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        refused(mem.url, gina)
        assert time.monotonic() - started < 5 + 5
        r = httpx.get(f"{mem.url}/v1/memories", params={"user": gina}, timeout=30)
        assert r.status_code == 503, r.text
        plain = turn(mem.url, "Hello there.", gina, memory=False)
        assert plain["choices"][0]["finish_reason"] in ("length", "stop"), plain
    finally:
        os.killpg(service.proc.pid, signal.SIGCONT)
    [memory] = remembered(mem.url, gina, 1)
    assert memory["id"] == told["id"]
    again = turn(mem.url, "Where do I live?", gina)
    assert [r.id for r in prompt_of(mem, again["id"]).recalled] == [told["id"]]


def test_a_killed_memory_service_loses_nothing_it_was_told(mem: Memory) -> None:
    """SIGKILL the memory service right after a memory turn: memory turns are refused
    while it is away, others are served; restarted, it has that turn (stored before the
    kill, or read again from the log: its offsets are committed after a batch is
    stored) and recalls it."""
    hugo = user_name()
    told = turn(mem.url, "My sister is called Ines.", hugo)
    service = mem.services["memory"]
    service.kill()
    refused(mem.url, hugo)
    plain = turn(mem.url, "Hello again.", hugo, memory=False)
    assert plain["usage"]["completion_tokens"] >= 1, plain
    port = int(mem.service_url.rsplit(":", 1)[1])
    mem.services["memory"], _ = start_memory(mem.pipeline, "memory-restarted", port=port)
    [memory] = remembered(mem.url, hugo, 1, timeout=120)
    assert memory["id"] == told["id"]
    asked = turn(mem.url, "What is my sister called?", hugo)
    assert [r.id for r in prompt_of(mem, asked["id"]).recalled] == [told["id"]]


def _every_table(database_url: str) -> list[str]:
    """Every row of every table of the store's database, as text."""
    rows = []
    with psycopg.connect(database_url) as conn:
        tables = [t for t, in conn.execute(
            "SELECT format('%I.%I', table_schema, table_name) FROM information_schema.tables"
            " WHERE table_type = 'BASE TABLE' AND table_schema NOT IN "
            "('pg_catalog', 'information_schema')")]
        for table in tables:
            rows += [f"{table}: {row}" for row in conn.execute(
                f"SELECT t::text FROM {table} AS t")]
    return rows


def test_nothing_a_user_said_survives_their_conversations_deletion(mem: Memory) -> None:
    """Every field of every route carries a marker: a session's title and user, a turn's
    messages, stop strings, user and Idempotency-Key, a streamed turn, a memory made and
    one forgotten. One conversation is deleted, one erased by id, one (whose first turn
    named no one) erased by user. Then no topic, table, log or metrics page holds the
    marker, and the deleted conversation takes nothing more."""
    from tests.sse import stream_chat
    from tests.test_erasure import every_record

    marker = f"MK{uuid.uuid4().hex[:12]}"
    user = f"{marker}-user"
    stack = mem.pipeline.stack

    def ask(body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(f"{mem.url}/v1/chat/completions", timeout=120,
                          headers=headers or {}, json={"model": MODEL, "max_tokens": 2,
                                                       **body})

    created = httpx.post(f"{mem.url}/v1/sessions", timeout=30, json={
        "title": f"{marker} title", "user": user, "memory": True})
    assert created.status_code == 201, created.text
    deleted = created.json()["id"]
    first = ask({"messages": [{"role": "user", "content": f"{marker} one"}],
                 "stop": [f"{marker} stop"], "user": user},
                {"X-Session-Id": deleted, "Idempotency-Key": f"{marker}-key"})
    assert first.status_code == 200, first.text
    streamed = stream_chat(mem.url, {"model": MODEL, "max_tokens": 4, "user": user,
                                     "messages": [{"role": "user",
                                                   "content": f"{marker} streamed"}]})
    assert streamed.done, streamed
    by_id = streamed.headers["x-session-id"]
    late = ask({"messages": [{"role": "user", "content": f"{marker} nobody yet"}]})
    assert late.status_code == 200, late.text
    by_user = late.headers["x-session-id"]
    named = ask({"messages": [{"role": "user", "content": f"{marker} now me"}],
                 "user": user, "memory": True}, {"X-Session-Id": by_user})
    assert named.status_code == 200, named.text
    keyed = ask({"messages": [{"role": "user", "content": f"{marker} keyed"}]},
                {"Idempotency-Key": f"{marker}-own-key"})
    assert keyed.status_code == 200, keyed.text
    made = remembered(mem.url, user, 2)
    forgot = httpx.delete(f"{mem.url}/v1/memories/{made[0]['id']}", timeout=30,
                          params={"user": user})
    assert forgot.status_code == 200, forgot.text
    mem.pipeline.wait_projected()

    for session in (deleted, keyed.headers["x-session-id"]):
        gone = httpx.delete(f"{mem.url}/v1/sessions/{session}", timeout=30)
        assert gone.status_code == 200, gone.text
    erased = cli(stack, "erase", "--conversation", by_id)
    assert erased.returncode == 0, erased.stderr
    erased = cli(stack, "erase", "--user", user)
    assert erased.returncode == 0 and "erased 1 conversation(s)" in erased.stdout, (
        erased.stdout, erased.stderr)
    # A deleted conversation takes nothing more: a turn, or a retry of a turn of it with
    # its Idempotency-Key (in its session, or the one the key made), with new content.
    prompts_before = len(read_records(stack.bootstrap, PROMPTS))
    refused = [ask({"messages": [{"role": "user", "content": f"{marker} after"}]},
                   headers) for headers in (
        {"X-Session-Id": deleted}, {"X-Session-Id": deleted,
                                    "Idempotency-Key": f"{marker}-key"},
        {"Idempotency-Key": f"{marker}-own-key"})]
    assert [r.status_code for r in refused] == [404, 404, 404], [r.text for r in refused]
    assert len(read_records(stack.bootstrap, PROMPTS)) == prompts_before
    mem.pipeline.wait_projected()
    deadline = time.monotonic() + 30
    while memories(mem.url, user):
        assert time.monotonic() < deadline, "the user's memories outlived the erasure"
        time.sleep(0.5)

    found = {"log": [r[:200] for r in every_record(stack.bootstrap) if marker.encode() in r],
             "store": [r[:200] for r in _every_table(stack.database_url) if marker in r]}
    found["service logs"] = [f"{path.name}: {line[:200]}" for path in stack.logs.glob("*.log")
                             for line in path.read_text(errors="replace").splitlines()
                             if marker in line]
    pages = [mem.service_url + "/metrics", mem.url + "/metrics",
             mem.pipeline.worker_metrics]
    found["metrics"] = [page for page in pages if marker in httpx.get(page, timeout=10).text]
    assert found == {"log": [], "store": [], "service logs": [], "metrics": []}, found
