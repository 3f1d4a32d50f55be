"""``/v1/chat/completions``: create a turn, re-attach to it, fetch it, cancel it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.edge import idempotency_key
from gateway.errors import api_error
from gateway.follow import Following
from gateway.http import caller_of, read_body, resources, tenant_of
from gateway.ids import parse_event_id
from gateway.openai_api import ChatRequest, finish_reason_json, parse_chat_request, usage_json
from gateway.problems import Problem, SessionNotFound
from gateway.wire import completion, sse_stream
from pipeline.tracing import TRACER, Span, from_http, ms_to_ns, record_headers

SESSION_HEADER = "X-Session-Id"
# Where a broken stream continues: GET it with the last chunk's ``event_id`` as
# ``Last-Event-ID`` (without one, the stream starts over).
RESUME_HEADER = "X-Resume-Url"


def parse_session_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise SessionNotFound(raw) from None


def sse_response(request: Request, events: AsyncGenerator[bytes, None],
                 headers: dict[str, str]) -> Response:
    """``events`` are whole SSE messages, framed as ``vllm serve`` frames them (LF line
    ends), which clients that split messages on ``"\n\n"`` (vLLM's benchmark client)
    need; EventSource takes it too."""
    return resources(request).streams.response(events, headers)


def turn_headers(following: Following) -> dict[str, str]:
    return {SESSION_HEADER: str(following.conversation_id),
            "X-Request-Id": following.completion_id}


def resume_url(completion_id: str) -> str:
    return f"/v1/chat/completions/{completion_id}/stream"


def stream_headers(following: Following) -> dict[str, str]:
    return {**turn_headers(following), RESUME_HEADER: resume_url(following.completion_id)}


async def respond(request: Request, chat_request: ChatRequest,
                  session: uuid.UUID | None) -> Response:
    """Accept a turn (or find the one an idempotency key names) and answer with it."""
    res = resources(request)
    span = TRACER.start_span("chat.request", context=from_http(request.headers),
                             kind=SpanKind.SERVER, attributes={
                                 "http.route": "/v1/chat/completions",
                                 "chat.stream": bool(chat_request.stream)})
    try:
        with trace.use_span(span, end_on_exit=False):
            carried = record_headers()  # the worker's spans go in this request's
            with TRACER.start_as_current_span("chat.accept"):
                following = await res.accept.accept(
                    chat_request, session, caller_of(request),
                    idempotency_key(request.headers.get("Idempotency-Key")), carried)
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.end()
        raise
    # The model that serves it, not the name the client sent (a span names nothing a
    # client wrote: docs/erasure.md).
    span.set_attributes({"chat.request_id": following.completion_id,
                         "chat.model": following.model})
    if chat_request.stream:  # data lines only, as vllm serve and OpenAI send
        events = sse_stream(res.follow, following, chat_request.include_usage())
        return sse_response(request, traced(events, span, following),
                            stream_headers(following))
    try:
        body = await completion(res.follow, following)
    except Problem as exc:  # the turn exists (timed out, failed): its ids go with the answer
        error = api_error(exc)
        return JSONResponse(error.body(), status_code=error.status,
                            headers={**error.headers, **turn_headers(following)})
    finally:
        span.end()
    return JSONResponse(body, headers=turn_headers(following))


def traced(events: AsyncGenerator[bytes, None], request_span: Span,
           following: Following) -> AsyncGenerator[bytes, None]:
    """``events`` as they are, untraced; traced, in a ``chat.stream`` span (and the
    first live record's ``chat.delta_hop``) that ends ``request_span`` with it."""
    if not request_span.is_recording():
        request_span.end()
        return events

    async def stream() -> AsyncGenerator[bytes, None]:
        parent = trace.set_span_in_context(request_span)
        span = TRACER.start_span("chat.stream", context=parent)
        hopped = False
        try:
            async for event in events:
                if not hopped and following.sub.first_live is not None:
                    hopped = True
                    written_ms, read_ns = following.sub.first_live
                    TRACER.start_span("chat.delta_hop", context=parent,
                                      start_time=ms_to_ns(written_ms),
                                      attributes={"chat.request_id": following.completion_id}
                                      ).end(end_time=read_ns)
                yield event
        finally:
            span.end()
            request_span.end()

    return stream()


async def create(request: Request) -> Response:
    res = resources(request)
    chat_request = parse_chat_request(await read_body(request, res.settings.max_body_bytes))
    raw_session = request.headers.get(SESSION_HEADER)
    session = parse_session_id(raw_session) if raw_session else None
    return await respond(request, chat_request, session)


async def stream(request: Request) -> Response:
    """Re-attach to a running or finished turn's stream (an EventSource can GET this).

    ``Last-Event-ID`` (header, or the ``last_event_id`` / ``starting_after`` query
    parameter) continues after that event; without it the stream starts over.
    """
    res = resources(request)
    completion = request.path_params["completion_id"]
    if request.method == "HEAD":  # a GET's headers, without attaching to the turn
        view, _ = await res.follow.find_turn(completion, tenant_of(request))
        return Response(media_type="text/event-stream", headers={
            SESSION_HEADER: str(view.id), "X-Request-Id": completion,
            RESUME_HEADER: resume_url(completion)})
    raw = (request.headers.get("last-event-id") or request.query_params.get("last_event_id")
           or request.query_params.get("starting_after"))
    following: Following = await res.follow.attach(
        completion, tenant_of(request), parse_event_id(raw) if raw else None, stream=True)
    include_usage = request.query_params.get("include_usage", "").lower() in ("1", "true")
    # With id lines, so that an EventSource sends the last one back when it reconnects.
    return sse_response(request, sse_stream(res.follow, following, include_usage, id_lines=True),
                        stream_headers(following))


async def retrieve(request: Request) -> Response:
    """A turn's status, and its reply once it has one."""
    res = resources(request)
    completion = request.path_params["completion_id"]
    view, turn = await res.follow.find_turn(completion, tenant_of(request))
    reply = next((m for m in view.messages.values()
                  if m.request_id == completion and m.role == "assistant"), None)
    body: dict[str, Any] = {
        "id": completion, "object": "chat.completion", "status": turn.status,
        "created": int(turn.submitted_at.timestamp()) if turn.submitted_at else None,
        "model": turn.model, "session_id": str(view.id), "choices": [],
    }
    if reply is not None:
        body["choices"] = [{"index": 0, "message": {"role": "assistant",
                                                    "content": reply.content},
                            "finish_reason": turn.finish_reason
                            and finish_reason_json(turn.finish_reason),
                            "logprobs": None}]
    if turn.usage is not None:
        body["usage"] = usage_json(turn.usage)
    if turn.error is not None:
        body["error"] = {"code": turn.error[0], "message": turn.error[1]}
    return JSONResponse(body)


async def cancel(request: Request) -> Response:
    res = resources(request)
    completion = request.path_params["completion_id"]
    status = await res.follow.cancel(completion, tenant_of(request))
    return JSONResponse({"id": completion, "object": "chat.completion.cancellation",
                         "status": status,
                         "cancelling": status in ("pending", "running")})
