"""The gateway's HTTP surface, composed as data in ``create_app``."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from psycopg_pool import AsyncConnectionPool
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.chat import ChatService
from gateway.errors import APIError, api_error_handler, http_error_handler, unexpected_error_handler
from gateway.metrics import GatewayMetrics
from gateway.openai_api import parse_chat_request
from gateway.sessions import SessionStore, parse_session_id
from gateway.tail import GenerationTail
from pipeline.kafka import AsyncConsumer, EventProducer
from pipeline.settings import CommonSettings, GatewaySettings
from pipeline.topics import PROMPTS

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
DEFAULT_TENANT = "default"


@dataclass
class Resources:
    chat: ChatService
    sessions: SessionStore
    registry: CollectorRegistry
    settings: GatewaySettings


def _resources(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    return resources


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes with a 413."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.",
                       code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"The request body is larger than {limit} bytes.",
                           code="request_too_large")
    return bytes(body)


async def chat_completions(request: Request) -> Response:
    res = _resources(request)
    body = await read_body(request, res.settings.max_body_bytes)
    chat_request = parse_chat_request(body)
    raw_session = request.headers.get(SESSION_HEADER)
    session = parse_session_id(raw_session) if raw_session else None
    turn = await res.chat.accept(chat_request, session, DEFAULT_TENANT,
                                 request.headers.get("Idempotency-Key"))
    headers = {SESSION_HEADER: str(turn.prompt.conversation_id), "X-Request-Id": turn.id}
    if chat_request.stream:
        return EventSourceResponse(res.chat.stream(turn, chat_request.include_usage()),
                                   headers=headers, ping=15)
    return JSONResponse(await res.chat.collect(turn), headers=headers)


async def session_messages(request: Request) -> Response:
    res = _resources(request)
    session = parse_session_id(request.path_params["session_id"])
    data = await res.sessions.messages(session, DEFAULT_TENANT)
    return JSONResponse({"object": "list", "session_id": str(session), "data": data})


async def list_models(request: Request) -> Response:
    models = _resources(request).chat.models
    return JSONResponse({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "chat-pipeline"} for m in models
    ]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_resources(request).registry),
                    media_type=CONTENT_TYPE_LATEST)


class RequestMetrics:
    """Counts responses by route template and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                path = getattr(route, "path", "unmatched")
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(settings: GatewaySettings, common: CommonSettings) -> Starlette:
    registry = CollectorRegistry()
    gateway_metrics = GatewayMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        producer = EventProducer(common.kafka_bootstrap, linger_ms=0)
        tail = GenerationTail(common.kafka_bootstrap)
        meta = AsyncConsumer(common.kafka_bootstrap, f"gateway-meta-{uuid.uuid4().hex[:12]}")
        pool = AsyncConnectionPool(common.database_url, min_size=1, max_size=10, open=False)
        await pool.open(wait=True, timeout=30)
        try:
            partitions = len(await meta.call(meta.partitions_sync, PROMPTS))
            await tail.start()
            sessions = SessionStore(pool, meta, partitions, settings.projection_wait_s)
            chat = ChatService(settings, producer, tail, sessions, gateway_metrics,
                               [m.strip() for m in settings.models.split(",") if m.strip()])
            app.state.resources = Resources(chat, sessions, registry, settings)
            yield
        finally:
            await tail.stop()
            await meta.close()
            producer.close()
            await pool.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/sessions/{session_id}/messages", session_messages, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            Exception: unexpected_error_handler,
        },
    )
    app.add_middleware(RequestMetrics, metrics=gateway_metrics)
    return app
