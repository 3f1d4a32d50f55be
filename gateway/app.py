"""The gateway's HTTP surface, composed as data in ``create_app``."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import completions, sessions
from gateway.auth import Authenticate, Guard
from gateway.chat import ChatService
from gateway.edge import LOOPBACK_HOSTS, AllowedHosts, JsonOnly
from gateway.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    problem_handler,
    unexpected_error_handler,
)
from gateway.fleet import Fleet
from gateway.http import Resources, resources
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_spec
from gateway.problems import Problem
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.tail import GenerationTail
from pipeline.kafka import QUICK_ASSIGN, AsyncConsumer, EventProducer
from pipeline.metrics import serve_metrics
from pipeline.settings import CommonSettings
from pipeline.topics import CONVERSATION_TOPICS, GENERATIONS, PROMPTS

log = logging.getLogger(__name__)


async def list_models(request: Request) -> Response:
    models = resources(request).chat.models
    return JSONResponse({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "chat-pipeline"} for m in models
    ]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(resources(request).registry),
                    media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec())


class RequestMetrics:
    """Counts responses by route template and status, and refusals by error code."""

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
                if message["status"] in (400, 401, 409, 413, 415, 429, 503):
                    self.metrics.rejected.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def served_hosts(settings: GatewaySettings) -> list[str]:
    """The ``Host`` names answered: loopback, the address listened on, and the setting."""
    own = [] if settings.host in ("0.0.0.0", "::", "") else [settings.host]
    return [*LOOPBACK_HOSTS, *own, *settings.allowed_hosts]


def create_app(settings: GatewaySettings, common: CommonSettings) -> Starlette:
    registry = CollectorRegistry()
    gateway_metrics = GatewayMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        label = uuid.uuid4().hex[:12]
        producer = EventProducer(common.kafka_bootstrap, linger_ms=0)
        meta = AsyncConsumer(common.kafka_bootstrap, f"gateway-meta-{label}")
        reader = AsyncConsumer(common.kafka_bootstrap, f"gateway-reader-{label}",
                               **QUICK_ASSIGN)
        fleet = Fleet(common.kafka_bootstrap, settings.max_backlog)
        pool = AsyncConnectionPool(common.database_url, min_size=1, max_size=10, open=False)
        await pool.open(wait=True, timeout=30)
        tail: GenerationTail | None = None
        # On an address of their own if asked (one only Prometheus reaches, say).
        stop_metrics = serve_metrics(registry, settings.metrics_port, settings.metrics_host)
        try:
            partitions = len(await meta.call(meta.partitions_sync, PROMPTS))
            for consumer in (meta, reader):  # so a client's first call waits for no lookup
                for topic in CONVERSATION_TOPICS:
                    await consumer.call(consumer.partitions_sync, topic)
            store = ConversationStore(pool, meta, reader, partitions, settings.projection_wait_s)

            async def end_of(partition: int) -> int:
                return await store.end_of(GENERATIONS, partition)

            tail = GenerationTail(common.kafka_bootstrap, end_of, settings.tail_linger_s,
                                  settings.stream_max_items, settings.stream_max_bytes)
            await tail.start()
            fleet.start()
            gateway_metrics.backlog.set_function(lambda: fleet.backlog)
            gateway_metrics.tailed_partitions.set_function(lambda: len(tail.partitions))
            guard = Guard(pool, settings.require_auth)
            log.info("API keys %s", "required" if await guard.enabled() else
                     "not required: no key exists (pipeline keys create), serving tenant "
                     "'default' to anyone who can reach this address")
            chat = ChatService(settings, producer, tail, store, fleet, guard, gateway_metrics,
                               settings.models)
            app.state.resources = Resources(chat, producer, guard, registry, settings)
            yield
        finally:
            stop_metrics()
            if tail is not None:
                await tail.stop()
            await fleet.stop()
            await reader.close()
            await meta.close()
            producer.close()
            await pool.close()

    routes = [
        Route("/v1/chat/completions", completions.create, methods=["POST"]),
        Route("/v1/chat/completions/{completion_id}", completions.retrieve, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}/stream", completions.stream,
              methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}/cancel", completions.cancel,
              methods=["POST"]),
        Route("/v1/sessions", sessions.create, methods=["POST"]),
        Route("/v1/sessions", sessions.list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id}", sessions.get, methods=["GET"]),
        Route("/v1/sessions/{session_id}", sessions.delete, methods=["DELETE"]),
        Route("/v1/sessions/{session_id}/messages", sessions.messages, methods=["GET"]),
        Route("/v1/sessions/{session_id}/messages", sessions.append, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if not settings.metrics_port:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error_handler,
            Problem: problem_handler,
            HTTPException: http_error_handler,
            Exception: unexpected_error_handler,
        },
    )
    # Last added runs first: metrics count every answer, then the host and the body's type
    # are checked before anyone is authenticated.
    app.add_middleware(Authenticate)
    app.add_middleware(JsonOnly)
    app.add_middleware(AllowedHosts, allowed=served_hosts(settings))
    app.add_middleware(RequestMetrics, metrics=gateway_metrics)
    return app
