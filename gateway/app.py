"""The gateway's HTTP surface, composed as data in ``create_app``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import completions, memories, page, sessions, usage
from gateway.accept import Accept
from gateway.admission import Admission
from gateway.auth import Authenticate, Guard
from gateway.connections import ConnectionLimits
from gateway.conversation_keys import ConversationKeys
from gateway.dependencies import Health
from gateway.edge import LOOPBACK_HOSTS, AllowedHosts, ClientAddress, JsonOnly, networks
from gateway.errors import (
    APIError,
    api_error_handler,
    client_left_handler,
    http_error_handler,
    problem_handler,
    unexpected_error_handler,
)
from gateway.eventstream import ServerSend, Streams
from gateway.fleet import Fleet
from gateway.follow import Follow
from gateway.http import Resources, resources
from gateway.memory import MemoryClient
from gateway.metrics import GatewayMetrics
from gateway.middleware import AnswerDeadline, RequestIds, RequestMetrics
from gateway.openapi import openapi_spec
from gateway.problems import Problem, StoreUnavailable
from gateway.session_log import Sessions
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore
from gateway.tail import GenerationTail
from pipeline import runtime
from pipeline.kafka import (
    QUICK_ASSIGN,
    EventProducer,
    KafkaException,
    LogReader,
    TransactionalProducer,
    TransactionSettings,
    topic_limits,
)
from pipeline.keystore import open_keyring
from pipeline.metrics import LoopWatch, serve_metrics
from pipeline.retry import Backoff
from pipeline.settings import CommonSettings
from pipeline.topics import CONVERSATION_TOPICS, LIVE, PROMPTS

log = logging.getLogger(__name__)


async def list_models(request: Request) -> Response:
    models = resources(request).admission.models
    return JSONResponse({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "chat-pipeline"} for m in models
    ]})


async def livez(request: Request) -> Response:
    """The process runs (a supervisor restarts it if this fails)."""
    return JSONResponse({"status": "alive"})


async def health(request: Request) -> Response:
    """Whether this gateway can take requests: 503, naming what is down, while Kafka or
    PostgreSQL does not answer (as last checked, every 2 s)."""
    down = resources(request).health.down
    if down:
        return JSONResponse({"status": "unavailable", "down": down}, status_code=503,
                            headers={"Retry-After": "2"})
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Whether requests can be served: as ``/health``, and, until it has once been so,
    whether every model of ``GATEWAY_MODELS`` has a live worker, which warms its engine
    up before it says it lives (``workers.engine.warm_up``). Once ready, a model's
    workers restarting make its turns wait or get 503, not the gateway unready."""
    res = resources(request)
    if res.health.down:
        return await health(request)
    if not res.ready:
        missing = sorted(set(res.settings.models) - res.admission.fleet.models)
        if missing:
            return JSONResponse(
                {"status": "warming", "waiting_for": {
                    m: "no worker serving it has warmed up yet" for m in missing}},
                status_code=503, headers={"Retry-After": "2"})
        res.ready = True
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(resources(request).registry),
                    media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_spec())


def served_hosts(settings: GatewaySettings) -> list[str]:
    """The ``Host`` names answered: loopback, the address listened on, and the setting."""
    own = [] if settings.host in ("0.0.0.0", "::", "") else [settings.host]
    return [*LOOPBACK_HOSTS, *own, *settings.allowed_hosts]


def create_app(settings: GatewaySettings, common: CommonSettings) -> Starlette:
    registry = CollectorRegistry()
    gateway_metrics = GatewayMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as opened:
            app.state.resources = await open_resources(opened, settings, common, registry,
                                                       gateway_metrics)
            runtime.settle()
            yield

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
        Route("/v1/usage", usage.get_usage, methods=["GET"]),
        Route("/v1/memories", memories.list_memories, methods=["GET"]),
        Route("/v1/memories", memories.delete_memories, methods=["DELETE"]),
        Route("/v1/memories/{memory_id}", memories.delete_memory, methods=["DELETE"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/", page.index, methods=["GET"]),
        Route("/static/{name}", page.asset, methods=["GET"]),
    ]
    if not settings.metrics_port:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = ServerSend(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error_handler,
            ClientDisconnect: client_left_handler,
            Problem: problem_handler,
            HTTPException: http_error_handler,
            Exception: unexpected_error_handler,
        },
    )
    # Last added runs first: metrics count every answer, then the host and the body's type
    # are checked before anyone is authenticated, and a read's deadline counts from then.
    app.add_middleware(Authenticate)
    app.add_middleware(JsonOnly)
    app.add_middleware(AllowedHosts, allowed=served_hosts(settings))
    app.add_middleware(AnswerDeadline, timeout_s=settings.answer_timeout_s)
    app.add_middleware(RequestIds)
    app.add_middleware(ClientAddress, trusted=networks(settings.trusted_proxies))
    app.add_middleware(RequestMetrics, metrics=gateway_metrics)
    # What uvicorn lets a client hold open (launch.services reads it for the protocol).
    app.state.connections = ConnectionLimits(
        settings.header_timeout_s, settings.body_timeout_s,
        settings.max_connections_per_address, tuple(networks(settings.trusted_proxies)),
        lambda reason: gateway_metrics.connections_refused.labels(reason).inc())
    Gauge("gateway_open_connections", "Connections open from capped client addresses",
          registry=registry).set_function(lambda: sum(app.state.connections.open.values()))
    return app


async def open_resources(opened: contextlib.AsyncExitStack, settings: GatewaySettings,
                         common: CommonSettings, registry: CollectorRegistry,
                         metrics: GatewayMetrics) -> Resources:
    """The gateway's resources, one after another, each closed when ``opened`` closes
    (in the reverse order: open streams first, the producers and the pool last)."""
    label = uuid.uuid4().hex[:12]
    bootstrap, timeout_s = common.kafka_bootstrap, settings.dependency_timeout_s
    # Control events: facts that may arrive late (prompts have producers of their own).
    producer = EventProducer(bootstrap, linger_ms=0, timeout_ms=int(timeout_s * 1000),
                             max_record_bytes=common.max_record_bytes,
                             compression=common.compression)
    opened.callback(producer.close)
    # Opened without waiting: a gateway starts while PostgreSQL is away (its requests that
    # need the store are refused meanwhile), and a connection broken by a restart of the
    # database is found and replaced when it is taken from the pool.
    pool = AsyncConnectionPool(common.database_url, min_size=1, max_size=10,
                               timeout=timeout_s, check=AsyncConnectionPool.check_connection,
                               kwargs={"connect_timeout": max(int(timeout_s), 1)}, open=False)
    await pool.open(wait=False)
    opened.push_async_callback(pool.close)
    # Partition counts and watermarks; the records of a conversation, read on request.
    meta = LogReader(bootstrap, f"gateway-meta-{label}", "meta")
    opened.push_async_callback(meta.close)
    reader = LogReader(bootstrap, f"gateway-reader-{label}", "reader", **QUICK_ASSIGN)
    opened.push_async_callback(reader.close)
    # The workers alive, and the backlog admission counts.
    fleet = Fleet(bootstrap, settings.max_backlog, configured=settings.models,
                  max_waiting_per_tenant=settings.max_waiting_per_tenant,
                  max_running_per_tenant=settings.max_running_per_tenant)
    opened.push_async_callback(fleet.stop)
    health = Health(meta, pool, timeout_s)
    opened.push_async_callback(health.stop)
    loop_watch = LoopWatch(registry, "gateway")
    loop_watch.start()
    opened.push_async_callback(loop_watch.stop)
    # On an address of their own if asked (one only Prometheus reaches, say).
    opened.callback(serve_metrics(registry, settings.metrics_port, settings.metrics_host))

    partitions = await _partitions(meta, settings.startup_timeout_s)
    # The conversations' data keys: content is sealed and opened with them.
    keyring = await asyncio.to_thread(open_keyring, common, f"gateway-{label}")
    opened.callback(keyring.close)
    for consumer in (meta, reader):  # so a client's first call waits for no lookup
        for topic in (*CONVERSATION_TOPICS, LIVE):
            await consumer.partitions(topic)
    # Turns: each prompt in a Kafka transaction. A prompt the topic would refuse is
    # refused alone, before it is queued.
    limits = await asyncio.to_thread(topic_limits, bootstrap, [PROMPTS],
                                     common.max_record_bytes)
    prompts = TransactionalProducer(
        bootstrap, f"chat-gateway-{socket.gethostname()}-{os.getpid()}-{label}",
        TransactionSettings(
            timeout_ms=max(int(settings.accept_timeout_s * 1000), 10_000),
            interval_ms=settings.transaction_interval_ms, max_record_bytes=limits[PROMPTS],
            limits=tuple(limits.items()), compression=common.compression))
    prompts.start()
    opened.push_async_callback(asyncio.to_thread, prompts.close, 10)
    codec = keyring.codec  # content sealed and opened with the conversations' keys
    store = ConversationStore(pool, meta, reader, partitions, codec, settings,
                              reads=metrics.log_reads)
    # The live stream and the durable record, tailed once for every client here.
    tail = GenerationTail(bootstrap, codec, store.ends_of, settings.tail_linger_s,
                          settings.stream_max_items, settings.stream_max_bytes,
                          timeout_s=timeout_s)
    await tail.start()
    opened.push_async_callback(tail.stop)
    fleet.start()
    health.start()
    metrics.backlog.set_function(lambda: fleet.backlog)
    metrics.tailed_partitions.set_function(lambda: len(tail.partitions))
    metrics.tail_rereads.set_function(lambda: tail.rereads)
    metrics.prompt_transactions.set_function(lambda: prompts.transactions)
    metrics.broker_clock_ahead.set_function(lambda: prompts.broker_clock_ahead_s)
    guard = Guard(pool, settings.require_auth, timeout_s=timeout_s,
                  failed_lookups=settings.failed_key_lookups,
                  refused=lambda by: metrics.rate_limit_refusals.labels(by).inc())
    await _say_whether_keys_are_required(guard)
    memory = MemoryClient(settings.memory_url, settings.memory_timeout_s)
    opened.push_async_callback(memory.close)
    # A new turn: admitted, built and committed (``accept``); then followed (``follow``).
    follow = Follow(settings, producer, tail, store, metrics)
    admission = Admission(settings, fleet, guard, follow.check_streams)
    keys = ConversationKeys(settings, keyring, producer)
    accept = Accept(settings, prompts, store, follow, admission, metrics, keys, memory)
    # Open streams: on shutdown, drained first (``GATEWAY_DRAIN_S``).
    streams = Streams(settings.send_timeout_s)
    streams.start()
    opened.push_async_callback(streams.stop)
    sessions = Sessions(settings, producer, store, keys, lambda: prompts.broker_clock_ahead_s)
    return Resources(accept, follow, sessions, admission, store, memory, guard, registry,
                     settings, health, streams)


async def _partitions(meta: LogReader, timeout_s: float) -> int:
    """The chat topics' partition count, waiting (with backoff) for Kafka to answer."""
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            return len(await meta.partitions(PROMPTS, 5.0))
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("waiting for Kafka to start the gateway: %s", exc)
            await asyncio.sleep(backoff.next())


async def _say_whether_keys_are_required(guard: Guard) -> None:
    try:
        required = await guard.enabled()
    except StoreUnavailable:
        log.warning("PostgreSQL is away: whether API keys are required is decided once it "
                    "answers (requests are refused meanwhile)")
        return
    log.info("API keys %s", "required" if required else
             "not required: no key exists (pipeline keys create), serving tenant "
             "'default' to anyone who can reach this address")
