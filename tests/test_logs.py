"""Structured logs: with PIPELINE_LOG_FORMAT=json each line is one JSON object, and a
line about a turn carries its request_id, conversation_id and tenant, whether bound to
the task that serves it (the gateway's requests) or given with the call (a worker's
turns). Concurrent requests never lend each other their fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from pipeline.codec import Position, summarise
from pipeline.erasures import Erasures, erasure_record
from pipeline.kafka import Record
from pipeline.logs import (
    MESSAGE_CHARS,
    JsonFormatter,
    TextFormatter,
    TurnFilter,
    bind_turn,
    shown,
    turn_fields,
)
from pipeline.topics import ERASURES
from schemas.rollout import Rollout


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(TurnFilter())
    logger = logging.getLogger(f"test-logs-{uuid.uuid4().hex}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield logger, out, handler
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_each_request_task_carries_its_own_turn(
        captured: tuple[logging.Logger, io.StringIO, logging.Handler]) -> None:
    logger, out, _ = captured

    async def request(n: int) -> None:
        bind_turn(request_id=f"chatcmpl-{n}", tenant=f"t{n}")
        await asyncio.sleep(0.01 * (3 - n))  # interleaved with the others
        bind_turn(conversation_id=f"c{n}")
        logger.info("turn %d", n)

    async def main() -> None:
        await asyncio.gather(*(request(n) for n in range(3)))
        logger.info("outside any request")

    asyncio.run(main())
    got = {line["message"]: line for line in lines(out)}
    for n in range(3):
        line = got[f"turn {n}"]
        assert (line["request_id"], line["conversation_id"], line["tenant"]) == (
            f"chatcmpl-{n}", f"c{n}", f"t{n}")
    assert not {"request_id", "tenant"} & set(got["outside any request"])


@dataclass
class Prompt:
    request_id: str
    conversation_id: uuid.UUID
    tenant: str


def test_fields_given_with_the_call_win_and_errors_stay_on_one_line(
        captured: tuple[logging.Logger, io.StringIO, logging.Handler]) -> None:
    logger, out, _ = captured
    prompt = Prompt("chatcmpl-w", uuid.uuid4(), "acme")

    async def worker() -> None:
        bind_turn(request_id="chatcmpl-other", tenant="other")
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            logger.exception("generation failed", extra=turn_fields(prompt))

    asyncio.run(worker())
    (line,) = lines(out)
    assert (line["request_id"], line["conversation_id"], line["tenant"], line["level"]) == (
        "chatcmpl-w", str(prompt.conversation_id), "acme", "ERROR")
    assert "ValueError: bad\nthing" in str(line["error"])
    assert out.getvalue().count("\n") == 1  # one line, newlines escaped


def test_text_lines_name_the_turn_too() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    record.request_id, record.tenant = "chatcmpl-1", "acme"
    assert TextFormatter().format(record).endswith(
        "x: hello [request_id=chatcmpl-1 tenant=acme]")


def test_a_line_quotes_at_most_so_much_of_what_it_was_given() -> None:
    """A record's bytes or a client's value in a message never make a line as long as
    themselves, in either format."""
    huge = b"k" * 1_000_000
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "keyed %r", (huge,), None)
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(record)
        assert len(line) < MESSAGE_CHARS + 200
        assert f"({len(repr(huge)) + 6 - MESSAGE_CHARS} more characters)" in line
    assert shown(huge) == f"{huge[:64]!r}... (1000000 bytes)"
    assert shown(b"short") == "b'short'" and shown(None) == "None"


def test_a_state_topic_full_of_records_it_cannot_hold_is_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every process reads ``chat.erasures`` and ``chat.rollouts`` from their start, and
    both are kept forever: records that are not theirs (any writer's garbage) are
    counted and said once in a while, not a line each at every start."""
    erasures = Erasures("127.0.0.1:1", "garbage", 3600.0)  # never started: no broker
    garbage = [b"", b"\x00", b"k" * 1_000_000, *(uuid.uuid4().bytes for _ in range(500))]
    records = [Record(Position(ERASURES, 0, i), key, b"{}", int(time.time() * 1000))
               for i, key in enumerate([None, *garbage])]
    with caplog.at_level(logging.WARNING, logger="pipeline.erasures"):
        erasures._apply(records)
    (message,) = [r.getMessage() for r in caplog.records]
    assert erasures.unreadable == len(records) and len(message) < 300
    assert erasures.revoked(uuid.uuid4()) is False

    nested = b'{"alias": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for value in (nested, b'{"alias": "' + b"x" * 1_000_000 + b'"}', b"\x00"):
        try:
            Rollout.model_validate_json(value)
        except ValidationError as exc:
            said = summarise(exc)
            assert "\n" not in said and len(said) < 200, said
        else:
            raise AssertionError("read as a rollout")


def host_clock(monkeypatch: pytest.MonkeyPatch, now: float) -> None:
    """``pipeline.erasures`` sees this host's clock read ``now``."""
    clock = type("Clock", (), {"time": staticmethod(lambda: now),
                               "monotonic": staticmethod(time.monotonic)})
    monkeypatch.setattr("pipeline.erasures.time", clock)


@pytest.mark.parametrize("host_ahead_s, broker_ahead_s", [(86_400 * 1.5, 0.0),
                                                          (0.0, 86_400 * 365)])
def test_an_erasure_is_held_two_windows_by_the_earlier_clock(
        monkeypatch: pytest.MonkeyPatch, host_ahead_s: float, broker_ahead_s: float) -> None:
    """An erasure is forgotten two windows after it was made: a host whose clock runs a
    day and a half ahead (forgetting by its clock alone dropped erasures of the last
    day, whose keys' records may still be in ``chat.keys``), or one broker whose stamp
    ran a year ahead, forgets none of them early."""
    window = 86_400.0
    true_now = time.time()
    host_clock(monkeypatch, true_now + host_ahead_s)
    erasures = Erasures("127.0.0.1:1", "clocks", 2 * window)  # never started: no broker
    ago = {uuid.uuid4(): age for age in (0.1 * window, 0.9 * window, 1.9 * window)}
    old = uuid.uuid4()
    stamped = [(c, true_now - age) for c, age in ago.items()] + [(old, true_now - 3 * window)]
    if broker_ahead_s:
        stamped.append((uuid.uuid4(), true_now + broker_ahead_s))
    erasures._apply([Record(Position(ERASURES, 0, i), str(c).encode(), b"{}", int(at * 1000))
                     for i, (c, at) in enumerate(stamped)])
    erasures._prune()
    assert all(erasures.revoked(c) for c in ago), "an erasure of the last two windows"
    assert not erasures.revoked(old), "one past two windows, by both clocks"
    erasures.add(made := uuid.uuid4())
    erasures._prune()
    assert erasures.revoked(made), "one this process made, before it is read back"


@pytest.mark.parametrize("host_ahead_s", [-86_400.0, 86_400.0])
def test_a_tenants_erasures_are_counted_in_the_brokers_time(
        monkeypatch: pytest.MonkeyPatch, host_ahead_s: float) -> None:
    """``GATEWAY_MAX_ERASURES_PER_TENANT`` counts a tenant's deletions over the last
    window of the brokers' time, which stamps them: a gateway a day ahead counted none
    (its cap held nothing back), one a day behind counted two windows' worth."""
    window = 86_400.0
    true_now = time.time()
    host_clock(monkeypatch, true_now + host_ahead_s)
    erasures = Erasures("127.0.0.1:1", "cap", 2 * window)  # never started: no broker
    ages = [0.1 * window] * 3 + [1.5 * window] * 2  # three in the window, two before it
    erasures._apply([Record(Position(ERASURES, 0, i), str(uuid.uuid4()).encode(),
                            erasure_record(uuid.uuid4(), "t1", "gateway-a")[1],
                            int((true_now - age) * 1000)) for i, age in enumerate(ages)])
    made, frees_in = erasures.asked("t1", true_now)
    assert made == 3 and 0.9 * window - 120 <= frees_in <= 0.9 * window + 60
