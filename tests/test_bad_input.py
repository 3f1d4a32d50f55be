"""Bad input is contained: a clear 4xx with an OpenAI-style error and nothing written;
undecodable records go to the dead-letter topic and every consumer keeps running."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.topics import CONTROL, DEADLETTER, GENERATIONS, PROMPTS
from tests.conftest import MODEL, Pipeline
from tests.logread import end_offsets, read_records

pytestmark = pytest.mark.integration

GOOD = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    pytest.param(b"{not json", {}, 400, "invalid_json", id="malformed-json"),
    pytest.param(b"[1, 2]", {}, 400, "invalid_json", id="not-an-object"),
    pytest.param(b'{"model": "tiny-random-llama"}', {}, 400, "missing_required",
                 id="missing-messages"),
    pytest.param(b'{"model": "tiny-random-llama", "messages": "hi"}', {}, 400, "invalid_value",
                 id="messages-wrong-type"),
    pytest.param(b'{"model": "tiny-random-llama", "messages": []}', {}, 400, "invalid_value",
                 id="messages-empty"),
    pytest.param(b'{"model": "tiny-random-llama", "temperature": "hot",'
                 b' "messages": [{"role": "user", "content": "x"}]}', {}, 400, "invalid_value",
                 id="temperature-wrong-type"),
    pytest.param(b'{"model": "tiny-random-llama", "max_tokens": 0,'
                 b' "messages": [{"role": "user", "content": "x"}]}', {}, 400, "invalid_value",
                 id="max-tokens-zero"),
    pytest.param(b'{"model": "tiny-random-llama",'
                 b' "messages": [{"role": "wizard", "content": "x"}]}', {}, 400, "invalid_value",
                 id="unknown-role"),
    pytest.param(b'{"model": "tiny-random-llama",'
                 b' "messages": [{"role": "user", "content": "nul \\u0000 here"}]}', {}, 400,
                 "invalid_value", id="nul-character"),
    pytest.param(b'{"model": "tiny-random-llama", "n": 2,'
                 b' "messages": [{"role": "user", "content": "x"}]}', {}, 400,
                 "unsupported_value", id="n-above-1"),
    pytest.param(b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
                 {}, 404, "model_not_found", id="unknown-model"),
    pytest.param(b'{"model": "tiny-random-llama", "messages": [{"role": "user", "content": "x"}]}',
                 {"X-Session-Id": str(uuid.uuid4())}, 404, "session_not_found",
                 id="unknown-session"),
    pytest.param(b'{"model": "tiny-random-llama", "messages": [{"role": "user", "content": "x"}]}',
                 {"X-Session-Id": "not-a-uuid"}, 404, "session_not_found",
                 id="malformed-session"),
    pytest.param(b'{"model": "tiny-random-llama", "messages": [{"role": "user", "content": "'
                 + b"x" * 1_100_000 + b'"}]}', {}, 413, "request_too_large", id="body-too-large"),
]


def table_counts(database_url: str) -> tuple[int, int, int]:
    with psycopg.connect(database_url) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM conversations),"
                           " (SELECT count(*) FROM messages),"
                           " (SELECT count(*) FROM generations)").fetchone()
    assert row is not None
    return row


@pytest.mark.parametrize(("body", "headers", "status", "code"), BAD_REQUESTS)
def test_bad_request_gets_a_clear_error_and_writes_nothing(
    pipeline: Pipeline, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    pipeline.wait_projected()  # earlier turns' rows must not land mid-test
    before = end_offsets(pipeline.stack.bootstrap, PROMPTS)
    rows_before = table_counts(pipeline.stack.database_url)
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", content=body, timeout=30,
                   headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert error["message"] and error["type"]
    assert end_offsets(pipeline.stack.bootstrap, PROMPTS) == before
    assert table_counts(pipeline.stack.database_url) == rows_before


def test_an_append_given_content_and_messages_both_is_refused(pipeline: Pipeline) -> None:
    """The session append takes ``content`` or ``messages``: with both, one of them was
    dropped without a word."""
    session = httpx.post(f"{pipeline.url}/v1/sessions", json={}, timeout=30).json()["id"]
    before = end_offsets(pipeline.stack.bootstrap, PROMPTS)
    r = httpx.post(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30, json={
        "content": "one", "messages": [{"role": "user", "content": "two"}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert end_offsets(pipeline.stack.bootstrap, PROMPTS) == before


def test_unknown_route_and_method_are_json_errors(pipeline: Pipeline) -> None:
    r = httpx.get(f"{pipeline.url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{pipeline.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{pipeline.url}/v1/sessions/{uuid.uuid4()}/messages")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_prompt_too_long_for_the_model_is_a_400(pipeline: Pipeline) -> None:
    long = " ".join(f"w{i}" for i in range(2000))  # far past the tiny model's 512 tokens
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # The turn was accepted, so it is recorded as failed, not lost.
    with psycopg.connect(pipeline.stack.database_url) as conn:
        deadline = time.monotonic() + 10
        while True:
            row = conn.execute("SELECT count(*) FROM generations WHERE status = 'failed'"
                               " AND error_code = 'context_length_exceeded'").fetchone()
            if (row and row[0] >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert row is not None and row[0] >= 1


def test_a_prompt_no_tokens_could_fit_is_refused_before_it_is_written(
        pipeline: Pipeline) -> None:
    """200 KB of text needs more tokens than the tiny model's 512 whatever they are: the
    worker says how many bytes its longest token stands for (14), so the gateway refuses
    the turn at once, naming the limit, and writes nothing."""
    before = end_offsets(pipeline.stack.bootstrap, PROMPTS)
    started = time.monotonic()
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x" * 200_000}]})
    assert time.monotonic() - started < 1.0
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]
    assert end_offsets(pipeline.stack.bootstrap, PROMPTS) == before


def test_undecodable_records_are_dead_lettered_and_consumers_keep_running(
    pipeline: Pipeline,
) -> None:
    bootstrap = pipeline.stack.bootstrap
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random"})
    garbage = [b"\x00\xffnot json", b'{"type": "PromptSubmitted", "v": 1}',
               b'{"type": "NoSuchEvent"}',
               # nested past what a parser follows: a worker that read its sealed key
               # raised RecursionError and exited, at each start again
               b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]
    positions = []
    for value in garbage:
        def remember(err: object, msg: object) -> None:
            assert err is None
            positions.append((msg.partition(), msg.offset()))  # type: ignore[attr-defined]
        producer.produce(PROMPTS, key=b"garbage", value=value, on_delivery=remember)
    assert producer.flush(10) == 0

    deadline = time.monotonic() + 30
    expected = {(c, p, o) for c in ("workers", "projector") for p, o in positions}
    while True:
        seen = set()
        for _, value, headers in read_records(bootstrap, DEADLETTER):
            if headers.get("source.topic") == PROMPTS.encode():
                key = (headers["consumer"].decode(), int(headers["source.partition"]),
                       int(headers["source.offset"]))
                if key in expected:
                    seen.add(key)
                    assert value in garbage
                    assert headers["reason"]
        if seen == expected or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert seen == expected

    # Both consumers are still running: a normal turn goes through and is stored.
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", json=GOOD, timeout=60)
    assert r.status_code == 200, r.text
    session = r.headers["x-session-id"]
    stored = httpx.get(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30).json()
    assert [m["role"] for m in stored["data"]] == ["user", "assistant"]


def _hostile(template: dict[str, object], field: str, value: object) -> bytes:
    """``template`` with ``field`` set to ``value``, as JSON (NaN and infinities as the
    bare words some writers put there, lone surrogates as escapes)."""
    text = json.dumps({**template, field: value}, allow_nan=True)
    return text.replace('"LONE-SURROGATE', '"\\ud800').encode()


_IDS = {"conversation_id": "00000000-0000-4000-8000-00000000dead", "request_id": "hostile",
        "tenant": "default", "occurred_at": "2026-11-26T00:00:00Z"}
# A well-formed event of each kind a consumer of each topic acts on.
TEMPLATES: dict[str, list[dict[str, object]]] = {
    PROMPTS: [{**_IDS, "type": "PromptSubmitted", "v": 4, "model": MODEL,
               "messages": [{"role": "user", "content": "hi"}]}],
    CONTROL: [{**_IDS, "type": "ClientDetached", "attachment": "a", "grace_s": 5},
              {**_IDS, "type": "GenerationCancelled"}],
    GENERATIONS: [{**_IDS, "type": "GenerationFinished", "v": 2, "model": MODEL,
                   "reply_seq": 1, "finish_reason": "stop", "text": "x", "deltas": 1,
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                   "duration_ms": 5}],
}
# Values that parse as JSON but no event may hold (schemas.events: one rule for all).
HOSTILE: list[tuple[str, object]] = [
    ("occurred_at", "2026-11-26T00:00:00"),  # naive
    ("occurred_at", "9999-12-31T23:59:59Z"),
    ("occurred_at", "0001-01-01T00:00:00Z"),
    ("tenant", "LONE-SURROGATE"),
    ("tenant", "nul\u0000here"),
    ("tenant", "t" * 100_000),
    ("request_id", ""),
    ("grace_s", 1e308),
    ("grace_s", float("inf")),
    ("duration_ms", float("inf")),
    ("duration_ms", float("nan")),
    ("reply_seq", 2**70),
    ("reply_seq", -1),
    ("history_len", 10**30),
    ("type", "NoSuchEvent"),
]


# Each hostile value in a field its event has (a field it does not have is kept unread).
APPLICABLE = [(topic, template, field, value) for topic, templates in TEMPLATES.items()
              for template in templates for field, value in HOSTILE
              if field in template or field == "type"
              or (field, template["type"]) in (("grace_s", "ClientDetached"),
                                               ("history_len", "PromptSubmitted"))]


@settings(max_examples=3, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(APPLICABLE), min_size=8, max_size=8))
def test_records_that_decode_but_no_event_may_hold_are_dead_lettered_by_every_consumer(
        pipeline: Pipeline, drawn: list[tuple[str, dict[str, object], str, object]]) -> None:
    """Hostile records written straight to each topic (naive and far-off times,
    infinities, NaN, huge and negative numbers, lone surrogates, NUL, long names, unknown
    types) reached code that only caught Kafka's and PostgreSQL's errors. Each consumer
    of the topic dead-letters each with its reason and keeps running; the store takes
    nothing of them."""
    bootstrap = pipeline.stack.bootstrap
    producer = Producer({"bootstrap.servers": bootstrap})
    written: dict[tuple[str, int, int], bytes] = {}
    for topic, template, field, value in drawn:
        record = _hostile(template, field, value)

        def remember(err: object, msg: Any, record: bytes = record) -> None:
            assert err is None, err
            written[(msg.topic(), msg.partition(), msg.offset())] = record
        producer.produce(topic, key=_IDS["conversation_id"].encode(), value=record,
                         on_delivery=remember)
    assert producer.flush(10) == 0
    readers = {PROMPTS: ("workers", "projector"), CONTROL: ("workers", "projector"),
               GENERATIONS: ("projector",)}
    expected = {(c, *position) for position in written for c in readers[position[0]]}
    deadline = time.monotonic() + 60
    while True:
        seen = set()
        for _, value, headers in read_records(bootstrap, DEADLETTER):
            key = (headers.get("consumer", b"").decode(),
                   headers.get("source.topic", b"").decode(),
                   int(headers.get("source.partition", b"-1")),
                   int(headers.get("source.offset", b"-1")))
            if key in expected:
                assert headers["reason"] and value == written[key[1:]]
                seen.add(key)
        if seen == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == expected, sorted(expected - seen)
    with psycopg.connect(pipeline.stack.database_url) as conn:
        stored = conn.execute(
            "SELECT (SELECT count(*) FROM conversations WHERE id = %(c)s),"
            " (SELECT count(*) FROM messages WHERE conversation_id = %(c)s),"
            " (SELECT count(*) FROM generations WHERE conversation_id = %(c)s"
            "  OR request_id = 'hostile')", {"c": _IDS["conversation_id"]}).fetchone()
    assert stored == (0, 0, 0)
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", json=GOOD, timeout=60)
    assert r.status_code == 200, r.text  # the worker and the projector still run
