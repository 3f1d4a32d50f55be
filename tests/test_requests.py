"""The gateway's reading of requests and its guards, without a broker: chat requests
(``gateway.openai_api``), usage queries, the auth guard's store calls, event streams'
middleware."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth import Guard
from gateway.errors import APIError
from gateway.openai_api import parse_chat_request
from gateway.usage_query import LATEST, UsageError, UsageQuery
from pipeline.settings import CommonSettings
from schemas import (
    ChatMessage,
)


def test_chat_request_maps_sampling_parameters() -> None:
    req = parse_chat_request(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_tokens": 9, "temperature": 0.2, "top_p": 0.5,'
        b' "stop": "END", "seed": 3, "stream_options": {"include_usage": true}}')
    assert req.messages[0].to_event() == ChatMessage(role="user", content="ab")
    sampling = req.sampling()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop,
            sampling.seed) == (9, 0.2, 0.5, ("END",), 3)
    assert req.include_usage()


def test_chat_request_carries_the_sampling_vllms_clients_send() -> None:
    """The penalties and vLLM's top_k, min_p and repetition_penalty reach the prompt
    event (``vllm bench serve`` sends them from its sampling options); out of range, 400."""
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    sampling = parse_chat_request({**base, "presence_penalty": 0.5, "frequency_penalty": -1,
                                   "top_k": 20, "min_p": 0.05,
                                   "repetition_penalty": 1.1}).sampling()
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_k,
            sampling.min_p, sampling.repetition_penalty) == (0.5, -1, 20, 0.05, 1.1)
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"min_p": 1.5},
                {"repetition_penalty": 0}, {"top_k": -2}):
        with pytest.raises(APIError) as err:
            parse_chat_request({**base, **bad})
        assert (err.value.status, err.value.param) == (400, next(iter(bad)))


@pytest.mark.parametrize(("field", "neutral", "asking"), [
    ("n", 1, 2), ("logprobs", False, True), ("top_logprobs", 0, 5),
    ("tools", [], [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto", "required"),
    ("response_format", {"type": "text"}, {"type": "json_object"}),
    ("logit_bias", {}, {"42": 100}), ("modalities", ["text"], ["text", "audio"]),
    ("use_beam_search", False, True), ("guided_json", None, {"type": "object"}),
])
def test_a_feature_the_service_does_not_honour_is_refused_never_ignored(
        field: str, neutral: object, asking: object) -> None:
    """A client asking for JSON output, tools or a logit bias got free text as if it
    had: each such field is a 400 naming it, unless it holds what asks for nothing."""
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    parse_chat_request({**base, field: neutral})
    with pytest.raises(APIError) as err:
        parse_chat_request({**base, field: asking})
    assert (err.value.status, err.value.param) == (400, field)
    assert err.value.body()["error"]["code"] == "unsupported_value"  # type: ignore[index]


def test_a_content_part_that_is_not_text_is_named_in_its_error() -> None:
    for parts, said in (([{"type": "text", "text": "a"}, {"type": "image_url"}],
                         "part 1 is 'image_url'"),
                        ([{"type": "text"}], "part 0 needs 'text'"),
                        (None, "a string or a list of text parts")):
        with pytest.raises(APIError) as err:
            parse_chat_request({"model": "m",
                                "messages": [{"role": "user", "content": parts}]})
        assert err.value.param == "messages.0.content"
        assert said in err.value.body()["error"]["message"]  # type: ignore[index]


@pytest.mark.parametrize("body", [b"", b"null", b'{"model": "m", "messages": [{"role": "user"}]}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "stop": ["a", "b", "c", "d", "e"]}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "logprobs": true}',
                                  # past a signed 64-bit integer: the prompt event's bound
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "seed": 9223372036854775808}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "stop": ""}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "stop": ["a", ""]}'])
def test_chat_request_errors_are_400s(body: bytes) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(body)
    assert err.value.status == 400
    assert err.value.body()["error"]["message"]  # type: ignore[index]


def test_usage_query_pages_and_defaults() -> None:
    now = 1_800_000_123
    q = UsageQuery.build("t", None, now, "1d", now=now)
    assert q.start % 86400 == 0 and q.page_end == now  # the current day is the last bucket
    assert (now - q.start) // 86400 == 6  # 7 buckets by default
    paged = UsageQuery.build("t", now - 100 * 60, now, "1m", limit=30)
    assert paged.page_end == paged.start + 30 * 60
    for bad in ({"bucket_width": "1w"}, {"limit": 0}, {"group_by": ["project_id"]},
                {"page": "x"}, {"page": "-5"}, {"page": str(10**15)}):
        with pytest.raises(UsageError):
            UsageQuery.build("t", now - 60, now, **{"bucket_width": "1m", **bad})
    # Far-off times are refused, not a 500 from datetime (year 11476 is out of range).
    for start, end in ((300_000_000_000, 300_000_000_060), (now, 10**12), (-1, now)):
        with pytest.raises(UsageError, match="Unix time from 0 to 253402300799"):
            UsageQuery.build("t", start, end, "1d")
    assert UsageQuery.build("t", LATEST - 60, LATEST + 1, "1m").page_end == LATEST + 1


def test_the_guard_asks_the_store_once_for_many_requests_waiting_on_the_same_answer() -> None:
    """10,000 streams opened at once each asked the store whether keys exist when the
    cached answer expired, and the pool's queue turned them into 503s: one query now
    serves every request waiting for it, and the next expiry asks again."""
    asked = 0

    async def ask() -> bool:
        nonlocal asked
        asked += 1
        await asyncio.sleep(0.05)
        return True

    async def scenario() -> list[bool]:
        guard = Guard(pool=None, require=False)  # type: ignore[arg-type]
        together = await asyncio.gather(*(guard._once("enabled", ask) for _ in range(500)))
        later = await guard._once("enabled", ask)
        return [*together, later]

    answers = asyncio.run(scenario())
    assert all(answers) and len(answers) == 501 and asked == 2


def test_event_streams_refuse_a_middleware_that_could_touch_their_bodies() -> None:
    """SSE bodies go straight to the server's send, past every middleware: the app takes
    only middleware that says it acts on the start message alone (ServerSend)."""
    from starlette.middleware.gzip import GZipMiddleware

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(), CommonSettings())
    assert len(app.user_middleware) == 7  # the gateway's own: each says START_ONLY
    with pytest.raises(TypeError, match="START_ONLY"):
        app.add_middleware(GZipMiddleware)


def test_a_read_answers_within_its_deadline_however_long_its_calls_take() -> None:
    """A read (GET) that chains slow calls is answered 503 ``answer_timeout`` once
    ``GATEWAY_ANSWER_TIMEOUT_S`` has passed, and what it waited on is cancelled. A stream
    that has started its answer runs on past it, and a write is never cut short."""
    import httpx
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from gateway.eventstream import ServerSend
    from gateway.middleware import AnswerDeadline

    cancelled: list[str] = []

    async def slow(request: object) -> JSONResponse:
        try:
            for _ in range(3):  # three calls, each within a dependency's own timeout
                await asyncio.sleep(0.4)
        except asyncio.CancelledError:
            cancelled.append("read")
            raise
        return JSONResponse({"late": True})

    async def stream(request: object) -> StreamingResponse:
        async def body() -> object:
            for part in (b"a", b"b", b"c"):
                await asyncio.sleep(0.3)
                yield part
        return StreamingResponse(body())

    app = ServerSend(routes=[Route("/read", slow, methods=["GET", "POST"]),
                             Route("/stream", stream, methods=["GET"])])
    app.add_middleware(AnswerDeadline, timeout_s=0.5)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway") as http:
            return [await http.get("/read"), await http.get("/stream"),
                    await http.post("/read")]

    refused, streamed, written = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "answer_timeout"
    assert "0.5 s" in refused.json()["error"]["message"]
    assert cancelled == ["read"]
    assert (streamed.status_code, streamed.content) == (200, b"abc")
    assert (written.status_code, written.json()) == (200, {"late": True})


def test_a_read_deadline_shorter_than_the_projection_wait_is_refused_at_start() -> None:
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    with pytest.raises(ValidationError, match=r"GATEWAY_ANSWER_TIMEOUT_S \(8\) must be longer"):
        GatewaySettings(answer_timeout_s=8, projection_wait_s=10)
    assert GatewaySettings().answer_timeout_s > GatewaySettings().projection_wait_s
