"""Wrapping middleware that every request passes: counting, request ids, and reads'
deadlines."""

from __future__ import annotations

import asyncio
import logging
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import api_error
from gateway.metrics import GatewayMetrics
from gateway.problems import AnswerTimeout
from pipeline.retry import QuietLog

_quiet = QuietLog(logging.getLogger(__name__))

REFUSALS = (400, 401, 409, 413, 415, 429, 503)


class RequestMetrics:
    """Counts responses by route template and status, refusals by status, and requests
    that failed unexpectedly as 500 (their answer is written outside this middleware)."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        def count(status: int) -> None:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()
            if status in REFUSALS:
                self.metrics.rejected.labels(str(status)).inc()

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                count(500)
            raise


class RequestIds:
    """Every answer carries ``X-Request-Id``: a turn's completion id where a handler set
    one (also on a 503, for a retry or a question), else one made for the request."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def identified_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", f"req-{uuid.uuid4().hex}".encode()))
                    message["headers"] = headers
            await send(message)

        await self.app(scope, receive, identified_send)


class AnswerDeadline:
    """A read (GET, HEAD) starts its answer within ``timeout_s`` of reaching the app,
    however many calls to Kafka and PostgreSQL it makes one after another (each bounded
    alone by ``GATEWAY_DEPENDENCY_TIMEOUT_S``, and a dependency that is slow but not down
    opens no breaker): past it, what it waits on is cancelled and its answer is 503
    ``answer_timeout`` with Retry-After. A stream's answer starts with its events: what
    it sends after that is not bounded here. Writes are not cut short: one stopped
    between its record's write and its answer would leave its client not knowing whether
    it was taken (each of their waits has its own bound: ``GATEWAY_ACCEPT_TIMEOUT_S``)."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True
    READS = frozenset({"GET", "HEAD"})

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.READS:
            await self.app(scope, receive, send)
            return
        started = False

        async def timed_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                deadline.reschedule(None)  # answering: no longer bounded here
            await send(message)

        try:
            async with asyncio.timeout(self.timeout_s) as deadline:
                await self.app(scope, receive, timed_send)
        except TimeoutError:
            if started or not deadline.expired():
                raise  # not this deadline's
            _quiet.warning("a read of %s took longer than %g s to answer: refused (503)",
                           scope.get("path", "?")[:200], self.timeout_s)
            await api_error(AnswerTimeout(self.timeout_s)).response()(scope, receive, send)
