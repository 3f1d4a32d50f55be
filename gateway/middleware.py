"""Wrapping middleware that every request passes: counting, and request ids."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics

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
