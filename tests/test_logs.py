"""Structured logs: with PIPELINE_LOG_FORMAT=json each line is one JSON object, and a
line about a turn carries its request_id, conversation_id and tenant, whether bound to
the task that serves it (the gateway's requests) or given with the call (a worker's
turns). Concurrent requests never lend each other their fields."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pipeline.logs import JsonFormatter, TextFormatter, TurnFilter, bind_turn, turn_fields


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
