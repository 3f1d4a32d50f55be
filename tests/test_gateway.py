"""The gateway on real Kafka and Postgres: resumable streams across gateway processes and
restarts, the sessions API reading its own writes, idempotent retries, cancellation
after a grace period, backlog admission, and a schemathesis fuzz pass.

The worker is the SIMULATED engine (20 tokens/s per sequence, token i is "t{i} "), so
streams are slow enough to interrupt and their text is known in advance.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from gateway.fleet import IDLE_INTERVAL_S, Fleet
from gateway.view import ConversationView
from infra.postgres import PostgresServer
from infra.process import free_port
from pipeline.codec import Position, conversation_key
from pipeline.partitioning import partition_for
from pipeline.topics import (
    CONTROL,
    CONVERSATION_TOPICS,
    DEADLETTER,
    GENERATIONS,
    LIVE,
    PROMPTS,
)
from projections.migrate import migrate
from schemas import (
    ClientAttached,
    ClientDetached,
    Event,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
)
from tests.conftest import PARTITIONS, Pipeline, Service, Stack, start_service, wait_healthy
from tests.logread import end_offsets, model_input, read_events, read_records
from tests.sse import Streamed, resume_chat, scrape, stream_chat
from workers.sim_engine import sim_token_text

pytestmark = pytest.mark.integration

GRACE_S = 2
RATE = 20  # simulated tokens/s per sequence


def expected(tokens: int) -> str:
    return "".join(sim_token_text(i) for i in range(tokens))


def chat(content: str, tokens: int, **extra: object) -> dict:
    return {"model": "sim", "max_tokens": tokens,
            "messages": [{"role": "user", "content": content}], **extra}


@dataclass
class Gateways(Pipeline):
    second: str = ""  # another gateway process on the same log


def start_gateway(stack: Stack, name: str, port: int, **env: str) -> Service:
    return start_service(stack, name, "gateway", "--port", str(port), GATEWAY_MODELS="sim",
                         GATEWAY_CANCEL_GRACE_S=str(GRACE_S), **env)


@pytest.fixture(scope="module")
def gw(sim_stack: Stack) -> Iterator[Gateways]:
    ports = free_port(), free_port()
    services = {
        "projector": start_service(sim_stack, "gw-projector", "projector"),
        "worker": start_service(sim_stack, "gw-worker", "worker", "--engine", "sim",
                                "--max-num-seqs", "16", WORKER_SIM_TOKENS_PER_S=str(RATE)),
        "gateway-1": start_gateway(sim_stack, "gateway-1", ports[0]),
        "gateway-2": start_gateway(sim_stack, "gateway-2", ports[1]),
    }
    g = Gateways(sim_stack, f"http://127.0.0.1:{ports[0]}", services,
                 second=f"http://127.0.0.1:{ports[1]}")
    try:
        for url in (g.url, g.second):
            wait_healthy(url, list(services.values()), timeout=60)
        warm = stream_chat(g.url, chat("warm", 2))
        assert warm.done and warm.text == expected(2), g.logs()
        yield g
    finally:
        for s in services.values():
            s.stop()


def turn_status(url: str, completion_id: str) -> str:
    r = httpx.get(f"{url}/v1/chat/completions/{completion_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["status"]


def wait_status(url: str, completion_id: str, wanted: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (status := turn_status(url, completion_id)) not in wanted:
        assert time.monotonic() < deadline, f"{completion_id} is still {status}"
        time.sleep(0.2)
    return status


def wait_logged(g: Gateways, topic: str, found: Callable[[Position, Event], bool], what: str,
                timeout: float = 10) -> None:
    """Until the log holds an event ``found`` accepts."""
    deadline = time.monotonic() + timeout
    while not any(found(pos, e) for pos, e in read_events(g.stack.bootstrap, topic)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def positions(ids: list[str]) -> list[tuple[int, ...]]:
    """Each SSE event id as numbers: partition, offset (in chat.live) and index."""
    return [tuple(int(n) for n in i.split("-")) for i in ids]


# -- resumable streams ------------------------------------------------------------
def test_stream_resumes_on_another_gateway_exactly(gw: Gateways) -> None:
    first = stream_chat(gw.url, chat("resume me", 60), stop_after=10)
    # (a chunk may hold several tokens: the gateway merges deltas while a reader lags)
    assert not first.done and first.text and expected(60).startswith(first.text)
    # The turn goes on meanwhile (the client comes back within the grace, 2 s: only the
    # partition's end is read, not the whole live stream, which takes longer than that
    # once the suite has filled it).
    partition = positions([first.last_id])[0][0]
    stopped_at = end_offsets(gw.stack.bootstrap, LIVE)[partition]
    deadline = time.monotonic() + 10
    while end_offsets(gw.stack.bootstrap, LIVE)[partition] <= stopped_at:
        assert time.monotonic() < deadline, "timed out waiting for the turn to go on"
        time.sleep(0.1)
    rest = resume_chat(gw.second, first.request_id, first.last_id)
    assert rest.done and rest.finish_reason == "length", rest.error
    assert first.text + rest.text == expected(60)  # no gap, no duplicate
    seen = positions(first.ids + rest.ids)
    assert seen == sorted(set(seen))  # every event once, in log order
    assert rest.chunks[0]["id"] == first.request_id and "role" not in rest.chunks[0][
        "choices"][0]["delta"]


def test_streams_are_framed_as_vllm_serve_frames_them(gw: Gateways) -> None:
    """A POST stream is ``data: ...\\n\\n`` messages only (clients that split on blank
    lines need it), its resume position in each chunk's JSON and its resume address in a
    header; the re-attach stream adds the ``id:`` lines an EventSource resends."""
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=60,
                      json={**chat("framing", 6), "stream": True}) as resp:
        raw = resp.read()
    assert resp.status_code == 200 and b"\r" not in raw and raw.endswith(b"\n\n")
    messages = [m for m in raw.decode().split("\n\n") if m and not m.startswith(":")]
    assert all(m.startswith("data: ") and "\n" not in m for m in messages), messages
    assert messages[-1] == "data: [DONE]"
    chunks = [json.loads(m[len("data: "):]) for m in messages[:-1]]
    ids = [c["event_id"] for c in chunks]
    assert positions(ids) == sorted(set(positions(ids)))
    resume = resp.headers["x-resume-url"]
    assert resume == f"/v1/chat/completions/{chunks[0]['id']}/stream"
    again = resume_chat(gw.second, chunks[0]["id"])
    # Deltas of one live record reach a live reader merged, under the last one's id; read
    # from the log they come one by one: every id sent live is among those read again.
    assert again.id_lines == again.ids and set(ids) <= set(again.ids)
    assert again.text == "".join(c["choices"][0]["delta"].get("content", "")
                                 for c in chunks) == expected(6)


def test_finished_stream_replays_from_the_log(gw: Gateways) -> None:
    done = stream_chat(gw.url, chat("replay", 8))
    assert done.done
    whole = resume_chat(gw.second, done.request_id)  # no Last-Event-ID: from the start
    assert (whole.text, whole.finish_reason) == (done.text, "length")
    assert whole.ids[0] == done.ids[0] and whole.ids[-1] == done.ids[-1]
    tail = resume_chat(gw.second, done.request_id, whole.ids[3])
    assert tail.ids == whole.ids[4:] and tail.text == expected(8)[len("t0 t1 t2 "):]


def test_killed_gateway_stream_resumes_on_a_restarted_one(gw: Gateways) -> None:
    port = free_port()
    victim = start_gateway(gw.stack, "gateway-victim", port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [victim], timeout=60)
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(stream_chat, url, chat("survive", 80))
            deadline = time.monotonic() + 20
            while scrape(f"{url}/metrics").get("gateway_streamed_tokens_total", 0) < 10:
                assert time.monotonic() < deadline, "the stream never got going"
                time.sleep(0.1)
            victim.kill()  # SIGKILL: no goodbye to the client, no ClientDetached
            cut = reading.result()
        assert cut.broken and not cut.done and cut.ids, cut
        restarted = start_gateway(gw.stack, "gateway-restarted", port)
        try:
            wait_healthy(url, [restarted], timeout=60)
            rest = resume_chat(url, cut.request_id, cut.last_id)
        finally:
            restarted.stop()
    finally:
        victim.stop()
    assert rest.done and cut.text + rest.text == expected(80)


def test_bad_last_event_ids_are_400s(gw: Gateways) -> None:
    earlier = stream_chat(gw.url, chat("ids", 3))
    done = stream_chat(gw.url, chat("ids", 3), headers={"X-Session-Id": earlier.headers[
        "x-session-id"]})  # the same partition
    partition = int(done.ids[0].split("-")[0])
    for bad in ("nonsense", f"{partition + 1}-0-0", earlier.ids[0], f"{partition}-1-2-3"):
        r = httpx.get(f"{gw.url}/v1/chat/completions/{done.request_id}/stream",
                      headers={"Last-Event-ID": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id"
    # A position after the turn (past the log's end): refused at once, nothing read.
    for beyond in (f"{partition}-999999999999-0", f"{partition}-999999999999"):
        started = time.monotonic()
        r = httpx.get(f"{gw.url}/v1/chat/completions/{done.request_id}/stream",
                      headers={"Last-Event-ID": beyond}, timeout=10)
        assert time.monotonic() - started < 2
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_last_event_id"
    unknown = f"chatcmpl-{uuid.uuid4().hex}{'0' * 16}"
    for path in (unknown, f"{unknown}/stream", "not-an-id/stream"):
        r = httpx.get(f"{gw.url}/v1/chat/completions/{path}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "completion_not_found"


def test_a_resume_from_the_partitions_start_reads_the_turn_alone(gw: Gateways) -> None:
    """A Last-Event-ID at the start of the partition, with the live stream full before the
    turn: the gateway reads the turn's own span, never the records before it, and sends
    the turn whole from its start."""
    session = httpx.post(f"{gw.url}/v1/sessions", json={}, timeout=30).json()["id"]
    partition = partition_for(conversation_key(uuid.UUID(session)), PARTITIONS)
    fill_live(gw.stack.bootstrap, partition, FILLER)
    time.sleep(3)  # more than a worker's clock margin before the turn (gateway.follow)
    done = stream_chat(gw.url, chat("bounded", 6), headers={"X-Session-Id": session})
    assert done.done and positions(done.ids)[0][0] == partition
    before = scrape(f"{gw.second}/metrics")
    started = time.monotonic()
    whole = resume_chat(gw.second, done.request_id, f"{partition}-0-0", timeout=30)
    took = time.monotonic() - started
    after = scrape(f"{gw.second}/metrics")
    assert whole.done and whole.text == expected(6) and whole.ids == done.ids, whole
    read = {t: after.get(f'gateway_log_read_records_total{{topic="{t}"}}', 0)
            - before.get(f'gateway_log_read_records_total{{topic="{t}"}}', 0)
            for t in (LIVE, GENERATIONS)}
    assert read[LIVE] < FILLER / 10, (read, took)  # its span, not the partition
    assert took < 5, took


FILLER = 20_000  # live records before a turn: what a resume must not read


def fill_live(bootstrap: str, partition: int, records: int) -> None:
    """``records`` live batches of no one's turn in ``partition`` of ``chat.live`` (valid,
    so every reader takes and passes them over)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "compression.type": "none"})
    value = json.dumps({"type": "LiveBatch", "v": 1, "worker": "filler",
                        "at": int(time.time() * 1000), "starts": [],
                        "deltas": [[2**40, 0, "x" * 512, []]], "ends": [], "failures": [],
                        "sealed": []}).encode()
    for _ in range(records):
        while True:
            try:
                producer.produce(LIVE, value=value, partition=partition)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0


# -- cancellation: grace period, re-attach, background ----------------------------
def test_client_gone_past_the_grace_period_stops_the_turn(gw: Gateways) -> None:
    gone = stream_chat(gw.url, chat("leave", 400), stop_after=3)
    wait_logged(gw, CONTROL, lambda _, e: isinstance(e, ClientDetached)
                and e.request_id == gone.request_id, "the client's leaving to be logged")
    assert turn_status(gw.second, gone.request_id) == "running"  # still within the grace
    assert wait_status(gw.second, gone.request_id, {"cancelled", "finished"},
                       GRACE_S + 10) == "cancelled"


def test_reattaching_within_the_grace_period_keeps_the_turn(gw: Gateways) -> None:
    first = stream_chat(gw.url, chat("come back", 4 * GRACE_S * RATE), stop_after=3)
    wait_logged(gw, CONTROL, lambda _, e: isinstance(e, ClientDetached)
                and e.request_id == first.request_id, "the client's leaving to be logged")
    rest = resume_chat(gw.second, first.request_id, first.last_id)
    assert rest.done and first.text + rest.text == expected(4 * GRACE_S * RATE)
    assert turn_status(gw.url, first.request_id) == "finished"


def test_background_turn_runs_on_without_a_client(gw: Gateways) -> None:
    gone = stream_chat(gw.url, chat("background", (GRACE_S + 1) * RATE, background=True),
                       stop_after=2)
    assert wait_status(gw.url, gone.request_id, {"cancelled", "finished"},
                       GRACE_S + 15) == "finished"
    gw.wait_projected()  # so that the retrieve reads the turn from the store
    r = httpx.get(f"{gw.url}/v1/chat/completions/{gone.request_id}", timeout=30).json()
    assert r["choices"][0]["message"]["content"] == expected((GRACE_S + 1) * RATE)
    # Its end, as a client that streamed it saw it (was: finish_reason null, no usage).
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == (GRACE_S + 1) * RATE and "error" not in r


def test_head_on_a_stream_attaches_nothing(gw: Gateways) -> None:
    """HEAD answers a stream's headers without following the turn: before, it attached a
    client that never left (ClientAttached, no ClientDetached), so a turn every real
    client had left ran to its end, and the gateway kept the subscription forever."""
    left = stream_chat(gw.url, chat("head", 400), stop_after=2)
    head = httpx.head(f"{gw.second}/v1/chat/completions/{left.request_id}/stream", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["x-request-id"] == left.request_id
    assert head.headers["x-resume-url"] == f"/v1/chat/completions/{left.request_id}/stream"
    assert wait_status(gw.url, left.request_id, {"cancelled", "finished"},
                       GRACE_S + 15) == "cancelled"
    attached = [e for _, e in read_events(gw.stack.bootstrap, CONTROL)
                if isinstance(e, ClientAttached) and e.request_id == left.request_id]
    assert attached == []
    missing = httpx.head(f"{gw.url}/v1/chat/completions/chatcmpl-{'0' * 48}/stream",
                         timeout=30)
    assert missing.status_code == 404


def test_sessions_are_listed_while_a_turn_streams(gw: Gateways) -> None:
    """Listing waits for the projector to reach the log's end, transaction markers
    included: a projector that stored the positions past them only when idle made the
    list wait for a streaming turn to end (found by the chat page's reload test)."""
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_chat, gw.url, chat("list me", 20 * RATE))
        try:
            wait_for_tokens = time.monotonic() + 30
            while scrape(f"{gw.url}/metrics").get("gateway_streamed_tokens_total", 0) < 3:
                assert time.monotonic() < wait_for_tokens
                time.sleep(0.1)
            for _ in range(3):
                started = time.monotonic()
                listed = httpx.get(f"{gw.url}/v1/sessions", timeout=30)
                assert listed.status_code == 200
                assert time.monotonic() - started < 5  # the turn has ~15 s to go
                assert not streaming.done()
        finally:
            assert streaming.result().done


def test_explicit_cancel(gw: Gateways) -> None:
    background = stream_chat(gw.url, chat("stop me", 400, background=True), stop_after=2)
    r = httpx.post(f"{gw.second}/v1/chat/completions/{background.request_id}/cancel",
                   timeout=30)
    assert r.status_code == 200 and r.json()["cancelling"] is True
    assert wait_status(gw.url, background.request_id, {"cancelled", "finished"},
                       10) == "cancelled"


def test_a_turn_past_the_generation_timeout_is_refused_and_cancelled(gw: Gateways) -> None:
    """The deadline is kept by the fan-out's sweep, not a timer per delta: a JSON request
    still running past ``GATEWAY_GENERATION_TIMEOUT_S`` gets 504 in about that time and
    its turn is cancelled; a stream past it ends with an error event."""
    port = free_port()
    hasty = start_gateway(gw.stack, "gateway-hasty", port, GATEWAY_GENERATION_TIMEOUT_S="2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [hasty], timeout=60)
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("too long", 20 * RATE),
                       timeout=30)
        waited = time.monotonic() - started
        assert r.status_code == 504 and r.json()["error"]["code"] == "generation_timeout"
        assert 2 <= waited < 10, waited
        assert wait_status(gw.url, r.headers["x-request-id"], {"cancelled", "finished"},
                           30) == "cancelled"
        started = time.monotonic()
        streamed = stream_chat(url, chat("too long, streamed", 20 * RATE), timeout=30)
        assert time.monotonic() - started < 10
        assert streamed.error is not None and streamed.error["code"] == "generation_timeout"
        assert streamed.text and streamed.finish_reason is None  # cut short, not finished
    finally:
        hasty.stop()


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in found]


def test_several_gateway_processes_share_one_port(gw: Gateways) -> None:
    """``pipeline gateway --workers 2``: two whole gateways on one port, connections spread
    over both; one SIGKILLed is started again while the other serves; a taken port is one
    line and exit 2; SIGTERM stops them all, and so does their supervisor's death."""
    port, metrics = free_port(), free_port()
    while metrics + 1 == port:
        metrics = free_port()
    pair = start_gateway(gw.stack, "gateway-pair", port, GATEWAY_WORKERS="2",
                         GATEWAY_METRICS_PORT=str(metrics))
    started = [pair]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [pair], timeout=60)
        for i in (0, 1):  # both answer: the first only is not enough
            wait_healthy(f"http://127.0.0.1:{metrics + i}", [pair], timeout=60)
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda i: stream_chat(url, chat(f"pair {i}", 3)), range(24)))
        assert all(d.done and d.text == expected(3) for d in done)
        served = [scrape(f"http://127.0.0.1:{metrics + i}/metrics").get(
            'gateway_requests_total{route="/v1/chat/completions",status="200"}', 0)
            for i in (0, 1)]
        assert sum(served) == 24 and min(served) > 0, served  # spread over both
        victim = _children(pair.proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        after = stream_chat(url, chat("one down", 3))  # the other takes the connection
        assert after.done and after.text == expected(3)
        deadline = time.monotonic() + 30
        while victim in _children(pair.proc.pid) or len(_children(pair.proc.pid)) < 2:
            assert time.monotonic() < deadline, "the killed gateway was not started again"
            time.sleep(0.2)
        taken = subprocess.run([sys.executable, "-m", "launch", "gateway", "--workers", "2",
                                "--port", str(port)], env=gw.stack.env(), capture_output=True,
                               text=True, timeout=60)
        assert taken.returncode == 2 and "address in use" in taken.stderr, taken.stderr
        assert "Traceback" not in taken.stderr
        children = _children(pair.proc.pid)
        pair.proc.terminate()
        assert pair.proc.wait(60) == 0
        assert not any(Path(f"/proc/{c}").exists() for c in children)
        # A supervisor SIGKILLed takes its gateways with it: none is left serving, orphaned.
        again = start_gateway(gw.stack, "gateway-pair-again", port, GATEWAY_WORKERS="2")
        started.append(again)
        wait_healthy(url, [again], timeout=60)
        children = _children(again.proc.pid)
        os.kill(again.proc.pid, signal.SIGKILL)
        again.proc.wait()
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{c}").exists() for c in children):
            assert time.monotonic() < deadline, "the gateways outlived their supervisor"
            time.sleep(0.2)
    finally:
        for service in started:
            service.stop()


def test_a_transaction_floor_lets_prompts_sent_apart_share_a_transaction(gw: Gateways) -> None:
    """``GATEWAY_TRANSACTION_INTERVAL_MS``: ten prompts sent 50 ms apart, which back to
    back would each get a transaction of their own, share the floor's (at most two), and
    each is accepted and served whole."""
    port = free_port()
    spaced = start_gateway(gw.stack, "gateway-spaced", port,
                           GATEWAY_TRANSACTION_INTERVAL_MS="1000")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [spaced], timeout=60)
        # A new writer's first transaction finds its coordinator and partitions, which
        # takes long enough for prompts queued meanwhile to share the next one anyway.
        assert stream_chat(url, chat("warm", 1)).done
        before = scrape(f"{url}/metrics")["gateway_prompt_transactions"]

        def one(i: int) -> Streamed:
            time.sleep(0.05 * i)
            return stream_chat(url, chat(f"spaced {i}", 2))

        with ThreadPoolExecutor(10) as pool:
            done = list(pool.map(one, range(10)))
        assert all(d.done and d.text == expected(2) for d in done), done
        assert scrape(f"{url}/metrics")["gateway_prompt_transactions"] - before <= 2
    finally:
        spaced.stop()


# -- sessions ---------------------------------------------------------------------
def test_second_turn_sees_the_first_reply_while_the_projector_is_stopped(gw: Gateways) -> None:
    projector = gw.services["projector"]
    created = httpx.post(f"{gw.url}/v1/sessions", json={"title": "no projector"}, timeout=30)
    assert created.status_code == 201
    session = created.json()["id"]
    os.kill(projector.proc.pid, signal.SIGSTOP)  # the store stops following the log
    try:
        first = httpx.post(f"{gw.url}/v1/sessions/{session}/messages", timeout=60,
                           json={"content": "first", "max_tokens": 3})
        assert first.status_code == 200, first.text
        second = httpx.post(f"{gw.second}/v1/sessions/{session}/messages", timeout=60,
                            json={"content": "second", "max_tokens": 2})
        assert second.status_code == 200, second.text
        history = httpx.get(f"{gw.url}/v1/sessions/{session}/messages", timeout=30).json()
    finally:
        os.kill(projector.proc.pid, signal.SIGCONT)
    prompt = next(e for _, e in read_events(gw.stack.bootstrap, PROMPTS)
                  if e.request_id == second.json()["id"])
    assert isinstance(prompt, PromptSubmitted)
    assert [(m.role, m.content) for m in prompt.messages] == [("user", "second")]
    given = model_input(gw.stack.bootstrap, second.json()["id"])
    assert given is not None and [(m.role, m.content) for m in given] == [
        ("user", "first"), ("assistant", expected(3)), ("user", "second")]
    assert [(m["role"], m["content"]) for m in history["data"]] == [
        ("user", "first"), ("assistant", expected(3)), ("user", "second"),
        ("assistant", expected(2))]
    gw.wait_projected()
    with psycopg.connect(gw.stack.database_url) as conn:
        stored = conn.execute("SELECT role, content FROM messages WHERE conversation_id = %s"
                              " ORDER BY seq", (session,)).fetchall()
    assert stored == [(m["role"], m["content"]) for m in history["data"]]


def test_sessions_api_create_list_read_delete(gw: Gateways) -> None:
    ids = [httpx.post(f"{gw.url}/v1/sessions", json={"title": f"s{i}"}, timeout=30).json()["id"]
           for i in range(3)]
    page = httpx.get(f"{gw.second}/v1/sessions", params={"limit": 2}, timeout=30).json()
    assert [s["id"] for s in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = httpx.get(f"{gw.second}/v1/sessions", timeout=30,
                     params={"limit": 100, "after": page["data"][-1]["id"]}).json()
    assert rest["data"][0]["id"] == ids[0]
    one = httpx.get(f"{gw.url}/v1/sessions/{ids[1]}", timeout=30).json()
    assert one["title"] == "s1"

    reply = stream_chat(gw.url, chat("to be deleted", 3), headers={"X-Session-Id": ids[2]})
    assert reply.done
    deleted = httpx.delete(f"{gw.second}/v1/sessions/{ids[2]}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    for method, path in (("GET", ""), ("GET", "/messages"), ("DELETE", ""),
                         ("POST", "/messages")):
        r = httpx.request(method, f"{gw.url}/v1/sessions/{ids[2]}{path}", timeout=30,
                          json={"content": "x"} if method == "POST" else None)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = httpx.get(f"{gw.url}/v1/chat/completions/{reply.request_id}/stream", timeout=30)
    assert r.status_code == 404  # its stream went with it
    gw.wait_projected()
    with psycopg.connect(gw.stack.database_url) as conn:
        assert conn.execute("SELECT deleted, title FROM conversations WHERE id = %s",
                            (ids[2],)).fetchone() == (True, None)
        assert conn.execute("SELECT count(*) FROM messages WHERE conversation_id = %s",
                            (ids[2],)).fetchone() == (0,)
    listed = httpx.get(f"{gw.url}/v1/sessions", params={"limit": 100}, timeout=30).json()
    assert ids[2] not in {s["id"] for s in listed["data"]}


def test_the_gateway_fold_matches_the_projection(gw: Gateways) -> None:
    """The gateway's read model (``gateway.view``) applied to the whole log gives the
    rows the projector stored, for every conversation so far (the records it
    dead-lettered aside: events other modules wrote to break the store)."""
    gw.wait_projected()
    parked = {(h["source.topic"].decode(), int(h["source.partition"]),
               int(h["source.offset"])) for _, _, h in read_records(gw.stack.bootstrap, DEADLETTER)
              if h.get("consumer") == b"projector"}
    views: dict[uuid.UUID, ConversationView] = {}
    for topic in CONVERSATION_TOPICS:
        for position, event in read_events(gw.stack.bootstrap, topic):
            if (position.topic, position.partition, position.offset) in parked:
                continue
            views.setdefault(event.conversation_id, ConversationView(event.conversation_id)
                             ).apply(event, position.offset)
    with psycopg.connect(gw.stack.database_url) as conn:
        messages = conn.execute("SELECT conversation_id, seq, role, content FROM messages"
                                " ORDER BY 1, 2").fetchall()
        statuses = dict(conn.execute("SELECT request_id, status FROM generations").fetchall())
        deleted = {i for (i,) in conn.execute("SELECT id FROM conversations WHERE deleted")}
    folded = sorted((c, seq, m.role, m.content) for c, v in views.items()
                    for seq, m in v.messages.items())
    assert folded == messages
    assert {r: t.status for v in views.values() for r, t in v.turns.items()} == statuses
    assert {c for c, v in views.items() if v.deleted} == deleted and deleted


# -- idempotency and admission ------------------------------------------------------
def test_idempotent_retry_does_not_generate_twice(gw: Gateways) -> None:
    key = {"Idempotency-Key": f"key-{uuid.uuid4()}"}
    body = chat("once", 10)
    with ThreadPoolExecutor(2) as pool:  # two at once, through two gateways
        racing = list(pool.map(lambda url: httpx.post(f"{url}/v1/chat/completions", json=body,
                                                      headers=key, timeout=60),
                               (gw.url, gw.second)))
    later = httpx.post(f"{gw.second}/v1/chat/completions", json=body, headers=key, timeout=60)
    streamed = stream_chat(gw.url, body, headers=key)
    replies = [r.json() for r in (*racing, later)]
    assert all(r.status_code == 200 for r in (*racing, later))
    assert len({r["id"] for r in replies}) == 1
    assert {r["choices"][0]["message"]["content"] for r in replies} == {expected(10)}
    assert streamed.request_id == replies[0]["id"] and streamed.text == expected(10)
    events = [e for _, e in read_events(gw.stack.bootstrap, GENERATIONS)
              if e.request_id == replies[0]["id"]]
    assert sum(isinstance(e, GenerationStarted) for e in events) == 1  # generated once
    assert sum(isinstance(e, GenerationFinished) for e in events) == 1


def test_retries_racing_their_originals_get_the_whole_turn_even_once_it_has_streamed(
        gw: Gateways) -> None:
    """A retry whose prompt lands after its original's runs as the original, which may
    have started streaming before the retry's gateway began to follow it: that client
    is sent the turn from the log, from its first token (CI once saw a reply without
    it), then the live items after what the log read held. Many keys race at once,
    each through both gateways, answered whole and streamed, so some retries lose
    their race late. (Streams here once missed deltas from the middle: a live delta
    the log read had already given was merged with the next, and the two were dropped
    as one duplicate.)"""
    keys = [{"Idempotency-Key": f"race-{uuid.uuid4()}"} for _ in range(8)]
    body = chat("raced", 10)

    def post(url: str, key: dict[str, str]) -> str:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=key, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["id"] + " " + r.json()["choices"][0]["message"]["content"]

    def stream(url: str, key: dict[str, str]) -> str:
        s = stream_chat(url, body, headers=key, timeout=60)
        return f"{s.request_id} {s.text}"

    with ThreadPoolExecutor(len(keys) * 2) as pool:
        races = [(pool.submit(post, gw.url, key), pool.submit(stream, gw.second, key))
                 for key in keys]
        answers = [{f.result().split(" ", 1)[0]: f.result().split(" ", 1)[1] for f in race}
                   for race in races]  # request id -> text, per key
    assert all(list(a.values()) == [expected(10)] for a in answers), answers  # one, whole
    ids = [request_id for a in answers for request_id in a]
    starts = Counter(e.request_id for _, e in read_events(gw.stack.bootstrap, GENERATIONS)
                     if isinstance(e, GenerationStarted) and e.request_id in ids)
    assert starts == Counter(ids)  # each generated once


def accepted(url: str, body: dict[str, Any]) -> str:
    """A streaming turn accepted (its answer's headers read), its client gone at once."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return resp.headers["x-request-id"]


def running(url: str, request_ids: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(turn_status(url, r) != "running" for r in request_ids):
        assert time.monotonic() < deadline, "the long turns never all ran"
        time.sleep(0.2)


def test_ready_means_each_configured_model_has_a_warmed_worker(gw: Gateways) -> None:
    """``/readyz`` said ready as soon as Kafka and PostgreSQL answered, before any worker
    could start a turn (the first turns of a benchmark then waited out vLLM's warm-up).
    It waits until every configured model has a live worker, which warms its engine up
    before it says it lives; ``/health`` still says only whether the gateway can take
    requests. Once ready, a model's workers going away does not make it unready."""
    port = free_port()
    later = f"sim-later-{uuid.uuid4().hex[:6]}"
    gateway = start_service(gw.stack, "gateway-readiness", "gateway", "--port", str(port),
                            GATEWAY_MODELS=f"sim,{later}")
    url = f"http://127.0.0.1:{port}"
    worker: Service | None = None
    try:
        wait_healthy(url, [gateway], timeout=60)  # /health: the dependencies answer
        deadline = time.monotonic() + 30
        while True:  # until it has read the sim worker's heartbeats
            warming = httpx.get(f"{url}/readyz", timeout=10)
            assert warming.status_code == 503, warming.text
            if list(warming.json()["waiting_for"]) == [later]:
                break
            assert time.monotonic() < deadline, warming.text
            time.sleep(0.3)
        assert warming.headers["retry-after"]
        worker = start_service(gw.stack, "worker-readiness", "worker", "--engine", "sim",
                               "--served-model-name", later, "--max-num-seqs", "4")
        deadline = time.monotonic() + 60
        while (ready := httpx.get(f"{url}/readyz", timeout=10)).status_code != 200:
            assert worker.proc.poll() is None, worker.tail()
            assert time.monotonic() < deadline, ready.text
            time.sleep(0.3)
        assert "engine warmed up" in worker.tail(400), worker.tail()
        worker.stop()
        worker = None
        time.sleep(1)
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()


def test_a_store_known_down_is_refused_at_once_until_a_probe_sees_it_back(
        gw: Gateways) -> None:
    """Each call waited out the 5 s dependency timeout for its 503 while PostgreSQL was
    down, though the gateway knew it was: thousands of retrying clients held thousands of
    connections. Once a call has failed, later ones are refused at once (a breaker)
    until the gateway's probe sees the store answer; ``/readyz`` names it. Here the store
    is a PostgreSQL not started yet (20 calls: median under 100 ms), then started."""
    own = PostgresServer(home=Path(tempfile.mkdtemp(prefix="pipeline-test-pg-late-")),
                         port=free_port(), database="late")
    port = free_port()
    gateway = start_service(Stack(gw.stack.bootstrap, own.url, gw.stack.logs),
                            "gateway-no-store", "gateway", "--port", str(port),
                            GATEWAY_MODELS="sim")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert gateway.proc.poll() is None, gateway.tail()
            assert time.monotonic() < deadline, "/readyz never named the store"
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(f"{url}/readyz", timeout=10)
                if "postgres" in ready.json().get("down", {}):
                    break
            time.sleep(0.3)
        answers = []
        for _ in range(20):
            sent = time.monotonic()
            r = httpx.get(f"{url}/v1/sessions", timeout=30)
            answers.append((r, time.monotonic() - sent))
        assert {r.status_code for r, _ in answers} == {503}
        assert all(r.json()["error"]["code"] == "store_unavailable"
                   and r.headers["retry-after"] for r, _ in answers)
        seconds = sorted(t for _, t in answers)
        assert seconds[len(seconds) // 2] < 0.1, seconds
        own.start()
        migrate(own.url)
        deadline = time.monotonic() + 15
        # The store answers again (empty, no projector feeds it: the gateway then says
        # it lags behind the log, which it reads from the store).
        while "postgres" in httpx.get(f"{url}/readyz", timeout=10).text or (
                httpx.get(f"{url}/v1/sessions", timeout=30).json()
                .get("error", {}).get("code") == "store_unavailable"):
            assert time.monotonic() < deadline, "the store never answered again"
            time.sleep(0.2)
    finally:
        gateway.stop()
        own.stop()


def test_overload_gets_429_with_retry_after(gw: Gateways) -> None:
    """Prompts waiting for the worker's 16 slots (and its 2 of prefetch) make the backlog."""
    port = free_port()
    strict = start_gateway(gw.stack, "gateway-strict", port, GATEWAY_MAX_BACKLOG="3")
    url = f"http://127.0.0.1:{port}"
    # Background turns keep running after their clients hang up.
    long = [accepted(gw.url, chat(f"load {i}", 2000, background=True)) for i in range(24)]
    try:
        wait_healthy(url, [strict], timeout=60)
        deadline = time.monotonic() + 10
        while scrape(f"{url}/metrics").get("gateway_backlog", 0) <= 3:
            assert time.monotonic() < deadline, "the backlog never showed"
            time.sleep(0.2)
        before = end_offsets(gw.stack.bootstrap, PROMPTS)
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat("one more", 5), timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "backlog_full"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert end_offsets(gw.stack.bootstrap, PROMPTS) == before  # nothing was accepted
    finally:
        strict.stop()
        for request_id in long:
            httpx.post(f"{gw.url}/v1/chat/completions/{request_id}/cancel", timeout=30)


def test_an_idle_gateway_measures_a_backlog_seldom_and_at_once_when_a_turn_comes(
        stack: Stack) -> None:
    """Each gateway asked the broker for every model's group status every 0.25 s, idle
    or not (two requests each time, per model, per gateway process). A model it admits
    no turn for is measured every ``IDLE_INTERVAL_S``; the first turn admitted for it has
    it measured at once, and then every interval while turns come."""
    assert IDLE_INTERVAL_S >= 4  # what the waits below tell apart

    model = f"idle-{uuid.uuid4().hex[:8]}"  # (the models of live workers are measured too)

    async def scenario() -> tuple[int, float, int]:
        fleet = Fleet(stack.bootstrap, 100, configured=[model])
        measured: list[float] = []  # when ``model``'s backlog was measured
        measure = fleet._measure

        def counted(backlog: Any) -> None:
            if backlog is fleet._backlogs.get(model):
                measured.append(time.monotonic())
            measure(backlog)

        fleet._measure = counted  # type: ignore[method-assign]
        fleet.start()
        try:
            deadline = time.monotonic() + 30
            while not measured:
                assert time.monotonic() < deadline, "the backlog was never measured"
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)
            idle = len(measured) - 1  # measures after the first, with no turn
            admitted = time.monotonic()
            fleet.admit(model, "tenant")
            while measured[-1] < admitted:
                assert time.monotonic() - admitted < 3, "an admission woke no measure"
                await asyncio.sleep(0.01)
            woken = measured[-1] - admitted
            await asyncio.sleep(1.5)
            busy = sum(1 for at in measured if at > admitted)
            return idle, woken, busy
        finally:
            await fleet.stop()

    idle, woken, busy = asyncio.run(scenario())
    assert idle == 0
    assert woken < 3  # not the idle interval's wait
    assert busy >= 3  # measured every 0.25 s once a turn came (some 6 times in 1.5 s)


def test_running_turns_are_no_backlog_however_long_they_run(gw: Gateways) -> None:
    """The backlog is the prompts waiting to start, not every prompt past the committed
    offset: a worker commits only up to its oldest unfinished turn, so 12 long turns
    running (of its 16 slots) counted every prompt finished after them, and short turns
    were refused while the worker had room (40 of 40 with a bound of 20)."""
    port = free_port()
    bounded = start_gateway(gw.stack, "gateway-bound-20", port, GATEWAY_MAX_BACKLOG="20")
    url = f"http://127.0.0.1:{port}"
    long = [accepted(gw.url, chat(f"long {i}", 2000, background=True)) for i in range(12)]
    try:
        wait_healthy(url, [bounded], timeout=60)
        running(gw.url, long)
        with ThreadPoolExecutor(4) as pool:  # the four slots left
            answers = list(pool.map(lambda i: httpx.post(
                f"{url}/v1/chat/completions", json=chat(f"short {i}", 2), timeout=60),
                range(40)))
        refused = [a.json()["error"]["code"] for a in answers if a.status_code != 200]
        assert refused == [], refused
        assert all(a.json()["choices"][0]["message"]["content"] == expected(2)
                   for a in answers)
        assert all(turn_status(gw.url, r) == "running" for r in long)  # still running
    finally:
        bounded.stop()
        for request_id in long:
            httpx.post(f"{gw.url}/v1/chat/completions/{request_id}/cancel", timeout=30)


def test_fuzzing_the_openapi_schema_finds_no_server_error(
    gw: Gateways, tmp_path: Path
) -> None:
    """``pipeline fuzz`` (schemathesis, one worker: its workers are threads, and Python
    3.11's ast.parse, which hypothesis calls, is not thread-safe, CPython gh-106905), a
    short pass; ``/v1/usage`` is in the document, its numbers without their bounds."""
    assert "/v1/usage" in httpx.get(f"{gw.url}/openapi.json", timeout=10).json()["paths"]
    run = subprocess.run(
        [sys.executable, "-m", "launch", "fuzz", "--url", gw.url, "--examples", "25",
         "--seed", "1"], env=gw.stack.env(),
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # its example database is in the state dir
    assert " passed" in run.stdout and "failed" not in run.stdout.split("SUMMARY")[-1]
    for service in (gw.services["gateway-1"], gw.services["gateway-2"]):
        assert "Traceback" not in service.log.read_text(errors="replace"), service.tail(80)


def test_models_are_those_live_workers_serve(gw: Gateways) -> None:
    port = free_port()
    other = start_service(gw.stack, "gateway-models", "gateway", "--port", str(port),
                          GATEWAY_MODELS="only-configured")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [other], timeout=60)
        deadline = time.monotonic() + 15
        while (listed := [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
               ) != ["sim"]:
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
        assert stream_chat(url, chat("served", 2)).text == expected(2)
    finally:
        other.stop()


def test_a_long_session_is_rebuilt_from_a_bounded_number_of_turns(gw: Gateways) -> None:
    """A worker that keeps no history rebuilds each turn's from the log: since every
    ``INLINE``-th prompt carries its history whole, it follows fewer than ``INLINE``
    turns back however long the session grows."""
    inline, turns = 4, 11
    port, metrics_port = free_port(), free_port()
    services = [
        start_service(gw.stack, "long-worker", "worker", "--engine", "sim",
                      "--served-model-name", "sim-long", "--metrics-port", str(metrics_port),
                      WORKER_HISTORY_CACHE_CHARS="0", WORKER_SIM_TOKENS_PER_S="200"),
        start_service(gw.stack, "long-gateway", "gateway", "--port", str(port),
                      GATEWAY_MODELS="sim-long",
                      GATEWAY_HISTORY_INLINE_EVERY=str(inline)),
    ]
    url = f"http://127.0.0.1:{port}"
    worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_healthy(url, services, timeout=60)
        session, reads = None, []
        for n in range(turns):
            before = scrape(worker_metrics).get("worker_history_reads_total", 0) \
                if n else 0.0
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           headers={"X-Session-Id": session} if session else {},
                           json={"model": "sim-long", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": f"turn {n}"}]})
            assert r.status_code == 200, r.text
            session = r.headers["x-session-id"]
            reads.append(scrape(worker_metrics).get("worker_history_reads_total", 0) - before)
        rebuilt = scrape(worker_metrics).get("worker_histories_rebuilt_total", 0)
        messages = httpx.get(f"{url}/v1/sessions/{session}/messages", timeout=30).json()
    finally:
        for s in services:
            s.stop()
    # Every turn after the first is rebuilt but those that carry their history whole.
    inlined = len([n for n in range(1, turns) if n % inline == 0])
    assert rebuilt == turns - 1 - inlined
    # Two records (a prompt and its end) per turn followed back, fewer than INLINE turns.
    assert max(reads) <= 2 * (inline - 1) and sum(reads) < (turns - 1) * turns, reads
    assert [m["content"] for m in messages["data"] if m["role"] == "user"] == [
        f"turn {n}" for n in range(turns)]
