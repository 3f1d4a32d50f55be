"""``pipeline memory``: the memory store's consumer and the recall API, in one process.

The consumer reads the conversation topics in group ``memory`` (one store per group;
a rebuild reads in a group of its own) and applies each batch in one transaction
(``memory.store``); offsets are committed after it, and a batch read again adds nothing.
A record that is not an event goes to the dead-letter topic.

The HTTP API is for gateways, on a private network (it takes the tenant it is told):
``POST /v1/recall`` (the user's memories nearest a text), ``GET /v1/memories``,
``DELETE /v1/memories[/{id}]`` (each forgetting written to ``chat.control`` before it
is applied: a rebuild forgets it too). Each call is bounded
(``MEMORY_REQUEST_TIMEOUT_S``): past it, or with PostgreSQL away, it is answered 503
with ``Retry-After``, which the gateway passes on as ``memory_unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from memory import store
from memory.embedder import Embedder
from memory.recalls import Recalls, TenantBusy
from memory.settings import MemorySettings
from memory.store import Remembered
from pipeline.codec import Codec, DecodeError, parse
from pipeline.deadletter import dead_letter
from pipeline.digests import Digester
from pipeline.kafka import EventProducer, GroupConsumer, Record
from pipeline.metrics import LATENCY_BUCKETS
from pipeline.projecting import Rounds, run_projection
from pipeline.retry import QuietLog
from pipeline.topics import CONTROL, CONVERSATION_TOPICS
from schemas import GenerationFinished, MemoryForgotten, PromptSubmitted, SessionDeleted
from schemas.conversation import storable

log = logging.getLogger(__name__)
CONSUMER_NAME = "memory"
MAX_QUERY_CHARS = 100_000
MAX_LISTED = 1000
BATCH_TIMEOUT_S = 60.0  # a consumer's batch in the database, connection wait included
# What the database raises when it, or the way to it, is gone or too slow.
DATABASE_AWAY = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout,
                 TimeoutError)


class MemoryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.remembered = Counter("memory_remembered", "Memories stored", registry=registry)
        self.evicted = Counter("memory_evicted", "Memories dropped for newer ones past "
                               "MEMORY_MAX_MEMORIES_PER_USER", registry=registry)
        self.forgotten = Counter("memory_forgotten", "Memories forgotten on request",
                                 registry=registry)
        self.recalls = Counter("memory_recalls", "Recall requests answered", registry=registry)
        self.refused = Counter("memory_recalls_refused", "Recalls refused (429) for a tenant "
                               "with MEMORY_MAX_WAITING_RECALLS_PER_TENANT waiting",
                               registry=registry)
        self.recall_seconds = Histogram("memory_recall_seconds",
                                        "Time to answer a recall (embedding and search)",
                                        registry=registry, buckets=LATENCY_BUCKETS)
        self.embed_seconds = Histogram("memory_embed_seconds", "Time to embed one batch",
                                       registry=registry, buckets=LATENCY_BUCKETS)
        self.dead_letters = Counter("memory_dead_letters",
                                    "Records that did not decode, sent to the dead-letter "
                                    "topic", registry=registry)
        self.retries = Counter("memory_retries", "Batches retried after a database error",
                               registry=registry)
        self.lag_events = Gauge("memory_lag_events",
                                "Records in the assigned partitions not yet applied",
                                registry=registry)


def remembered(event: PromptSubmitted, max_chars: int) -> Remembered | None:
    """What a prompt gives to remember: its last user message, if the turn has memory
    on and its content is readable here."""
    if not event.memory or event.user is None or event.erased:
        return None
    text = next((m.content for m in reversed(event.messages) if m.role == "user"), "")
    text = storable(text).strip()[:max_chars]
    if not text:
        return None
    return Remembered(event.tenant, event.user, event.request_id, event.conversation_id,
                      text, event.occurred_at)


class MemoryService:
    def __init__(self, settings: MemorySettings, bootstrap: str, database_url: str,
                 embedder: Embedder, registry: CollectorRegistry,
                 digests: Digester, codec: Codec) -> None:
        self.settings = settings
        self.codec = codec  # opens the prompts a memory is made of
        self.digests = digests  # a forgetting names its user by digest in the log
        self.bootstrap = bootstrap
        self.embedder = embedder
        self.registry = registry
        self.metrics = MemoryMetrics(registry)
        self.producer = EventProducer(bootstrap)
        self.pool = AsyncConnectionPool(
            database_url, min_size=1, max_size=settings.pool_size, open=False,
            check=AsyncConnectionPool.check_connection, kwargs={"connect_timeout": 10})
        self._quiet = QuietLog(log)
        self._last_lag = 0.0  # when the lag was last read (monotonic)
        # Recalls run a few at once, their places shared fairly between tenants.
        self.recalls = Recalls(settings.pool_size, settings.max_waiting_recalls_per_tenant)

    async def open(self) -> None:
        await self.pool.open(wait=False)

    @contextlib.asynccontextmanager
    async def _db(self, timeout_s: float) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection, its wait and its use all within ``timeout_s``; committed
        at the end unless the block raised."""
        async with asyncio.timeout(timeout_s), self.pool.connection(timeout_s) as conn:
            yield conn

    # -- the consumer ----------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Make memories of the log's turns until ``stop`` (``pipeline.projecting``): a
        batch the database does not take is taken again after a backoff."""
        window_s = self.settings.batch_max_ms / 1000
        consumer = GroupConsumer(self.bootstrap, self.settings.group, "memory",
                                 **{"session.timeout.ms": self.settings.session_timeout_ms})
        consumer.subscribe(list(CONVERSATION_TOPICS))

        def retrying(exc: BaseException, records: int, delay: float) -> None:
            self.metrics.retries.inc()
            self._quiet.warning("could not apply %d records (retrying in %.1f s): %s",
                                records, delay, exc)

        try:
            await run_projection(consumer, self,
                                 Rounds(self.settings.batch_max_events, 0.1, window_s), stop,
                                 (psycopg.Error, PoolTimeout, OSError, TimeoutError), retrying)
        finally:
            await consumer.close()

    async def project_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        if records:
            await self._apply(records)

    async def after_batch(self, consumer: GroupConsumer, records: list[Record]) -> None:
        """The batch's offsets committed; the lag, once a second."""
        if records:
            offsets: dict[tuple[str, int], int] = {}
            for r in records:
                offsets[(r.position.topic, r.position.partition)] = r.position.offset + 1
            try:
                await consumer.commit(offsets)
            except Exception as exc:  # a rebalance: read again, and adds nothing
                log.warning("could not commit memory offsets: %s", exc)
        if time.monotonic() - self._last_lag > 1.0:
            self._last_lag = time.monotonic()
            with contextlib.suppress(Exception):
                self.metrics.lag_events.set(sum((await consumer.lag()).values()))

    async def _apply(self, records: Sequence[Record]) -> None:
        events = []
        for record in records:
            try:
                # Content is opened only where a memory is made of it (no key looked
                # for a conversation without memory).
                event = parse(record.value)
                if isinstance(event, PromptSubmitted) and event.memory and event.sealed:
                    event = await self.codec.decode_async(record.value)
                events.append(event)
            except DecodeError as exc:
                self.metrics.dead_letters.inc()
                await dead_letter(self.producer, record, str(exc), CONSUMER_NAME)
        remember = [r for e in events if isinstance(e, PromptSubmitted)
                    for r in [remembered(e, self.settings.max_memory_chars)] if r is not None]
        vectors: list[list[float]] = []
        chunk = self.settings.embed_chunk
        for at in range(0, len(remember), chunk):  # a recall may go between chunks
            started = time.perf_counter()
            vectors += await self.embedder.embed([r.text for r in remember[at:at + chunk]])
            self.metrics.embed_seconds.observe(time.perf_counter() - started)
        async with self._db(BATCH_TIMEOUT_S) as conn:
            async with conn.transaction():
                # Ends and deletions first: a batch may hold a turn and its deletion.
                await store.finished(conn, [e.request_id for e in events
                                            if isinstance(e, GenerationFinished)])
                for e in events:
                    if isinstance(e, SessionDeleted):
                        await store.conversation_deleted(conn, e.conversation_id)
                    elif isinstance(e, MemoryForgotten):
                        await store.forget(conn, e.tenant, e.request_id)
                new = await store.remember(conn, list(zip(remember, vectors, strict=True)),
                                           self.embedder.name)
                evicted = await store.evict(conn, sorted({(r.tenant, r.user) for r in remember}),
                                            self.settings.max_memories_per_user)
        self.metrics.remembered.inc(new)
        self.metrics.evicted.inc(evicted)

    # -- the HTTP API ----------------------------------------------------------------
    def app(self) -> Starlette:
        return Starlette(exception_handlers={e: _database_away for e in DATABASE_AWAY},
                         routes=[
            Route("/v1/recall", self.recall, methods=["POST"]),
            Route("/v1/memories", self.list_memories, methods=["GET"]),
            Route("/v1/memories", self.forget_all, methods=["DELETE"]),
            Route("/v1/memories/{memory_id}", self.forget_one, methods=["DELETE"]),
            Route("/healthz", lambda _: JSONResponse({"status": "ok"})),
            Route("/metrics", lambda _: Response(generate_latest(self.registry),
                                                 media_type="text/plain; version=0.0.4")),
        ])

    async def recall(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await request.json()
        except ValueError:
            return problem(400, "invalid_json", "The body is not JSON.")
        if not isinstance(body, dict):
            return problem(400, "invalid_request", "The body is a JSON object.")
        who = _who(body)
        if isinstance(who, Response):
            return who
        text, k, exclude = body.get("text"), body.get("k", self.settings.recall_k), None
        if not isinstance(text, str) or len(text) > MAX_QUERY_CHARS:
            return problem(400, "invalid_request", f"text is a string of at most "
                           f"{MAX_QUERY_CHARS} characters")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 1000:
            return problem(400, "invalid_request", "k is an integer from 0")
        if body.get("exclude_session") is not None:
            try:
                exclude = uuid.UUID(str(body["exclude_session"]))
            except ValueError:
                return problem(400, "invalid_request", "exclude_session is a session id")
        k = min(k, self.settings.max_recall_k)
        found: list[store.Memory] = []
        if k and text.strip():
            try:
                async with asyncio.timeout(self.settings.request_timeout_s), \
                        self.recalls.place(who[0]):
                    vector = (await self.embedder.embed([storable(text)[:MAX_QUERY_CHARS]],
                                                        urgent=True))[0]
                    async with self._db(self.settings.request_timeout_s) as conn:
                        found = await store.nearest(conn, *who, vector, self.embedder.name,
                                                    k, exclude)
            except TenantBusy as exc:
                self.metrics.refused.inc()
                response = problem(429, "tenant_recalls_cap", f"Too many recalls of this "
                                   f"tenant at once: {exc}; try again shortly.")
                response.headers["Retry-After"] = "1"
                return response
        kept, total = [], 0
        for memory in found:  # the nearest first, within the size limit
            if total + len(memory.text) > self.settings.max_recall_chars:
                break
            kept.append({"id": memory.id, "text": memory.text})
            total += len(memory.text)
        self.metrics.recalls.inc()
        seconds = time.perf_counter() - started
        self.metrics.recall_seconds.observe(seconds)
        return JSONResponse({"memories": kept, "ms": round(seconds * 1000, 3)})

    async def list_memories(self, request: Request) -> Response:
        who = _who(dict(request.query_params))
        if isinstance(who, Response):
            return who
        async with self._db(self.settings.request_timeout_s) as conn:
            found = await store.listed(conn, *who, MAX_LISTED)
        return JSONResponse({"object": "list", "data": [m.json() for m in found]})

    async def forget_one(self, request: Request) -> Response:
        return await self._forget(request, request.path_params["memory_id"])

    async def forget_all(self, request: Request) -> Response:
        return await self._forget(request, None)

    async def _forget(self, request: Request, memory_id: str | None) -> Response:
        who = _who(dict(request.query_params))
        if isinstance(who, Response):
            return who
        tenant, user = who
        async with self._db(self.settings.request_timeout_s) as conn:
            found = await store.of_user(conn, tenant, user, memory_id)
            if memory_id is not None and not found:
                return problem(404, "memory_not_found", "No such memory of this user.")
            # Durable in the log first: a rebuild, and this store if it fails now, forget
            # it too.
            user_digest = self.digests.digest("user", tenant, user)
            await asyncio.gather(*(self.producer.send(CONTROL, MemoryForgotten(
                conversation_id=m.conversation_id, request_id=m.id, tenant=tenant,
                user=user_digest)) for m in found))
            for m in found:
                await store.forget(conn, tenant, m.id)
        self.metrics.forgotten.inc(len(found))
        if memory_id is not None:
            return JSONResponse({"id": memory_id, "object": "memory", "deleted": True})
        return JSONResponse({"object": "list", "deleted": len(found)})

    async def close(self) -> None:
        await self.pool.close()
        self.producer.close()


async def _database_away(_request: Request, exc: Exception) -> Response:
    """PostgreSQL away, or a call past its time: 503, to be tried again."""
    log.warning("memory call refused: %r", exc)
    response = problem(503, "memory_store_unavailable",
                       "The memory store did not answer in time; try again.")
    response.headers["Retry-After"] = "1"
    return response


def _who(fields: dict[str, Any]) -> tuple[str, str] | Response:
    tenant, user = fields.get("tenant"), fields.get("user")
    for name, value in (("tenant", tenant), ("user", user)):
        if not isinstance(value, str) or not 1 <= len(value) <= 200 or "\0" in value:
            return problem(400, "invalid_request", f"{name} is a name of 1 to 200 "
                           "characters")
    return tenant, user  # type: ignore[return-value]


def problem(status: int, code: str, message: str) -> JSONResponse:
    """An error in OpenAI's shape (the gateway passes it on as it is)."""
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}}, status_code=status)
