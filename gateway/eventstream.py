"""Server-sent event responses: a stream's messages come whole, as bytes, from an async
iterator (``gateway.cursor`` frames them), and each goes out in one ASGI send.

Why not sse-starlette's ``EventSourceResponse``, which this gateway used before: per
message it opened an anyio cancel scope for its send timeout (profiled under streaming
load, 14% of the gateway's event loop: anyio finds its backend anew each time), and per
stream it ran a task group of three or four tasks. Here a stream is its own task plus one
that waits for the client to leave; a stuck send is found by the one sweep the process
runs (``Streams``), not timed per message; keep-alives come from the stream itself.

* The client leaving (``http.disconnect``) stops the stream at once: its iterator is
  closed, so its cleanup runs (the gateway publishes that the client left).
* A send blocked for ``send_timeout_s`` (a client that stopped reading) drops the stream.
* HEAD gets the headers and no stream.
* The body goes straight to the server's own ``send`` (``ServerSend`` keeps it in the
  scope), past the middleware's wrappers: each of them acts on the start message only,
  and a body message per token through five of them was about a tenth of the gateway's
  CPU. So a middleware that changes response bodies (compression, say) must not wrap
  these routes: ``ServerSend.add_middleware`` takes only a middleware class that says
  ``START_ONLY = True`` (it reads or changes the start message only), and refuses any
  other at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-store",
               "Connection": "keep-alive", "X-Accel-Buffering": "no"}


SERVER_SEND = "gateway.server_send"


class ServerSend(Starlette):
    """Starlette that keeps the server's ``send`` in each scope, for ``EventStream``."""

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Only a middleware that acts on the start message alone (``START_ONLY``): an
        event stream's body messages go past every middleware."""
        if getattr(middleware_class, "START_ONLY", False) is not True:
            raise TypeError(
                f"{getattr(middleware_class, '__name__', middleware_class)} does not say "
                "START_ONLY = True: event streams send their bodies past every middleware "
                "(gateway.eventstream), so one that reads or changes response bodies would "
                "miss them")
        super().add_middleware(middleware_class, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class EventStream(Response):
    """One SSE response. ``messages`` is closed whatever happens."""

    def __init__(self, messages: AsyncGenerator[bytes, None], headers: Mapping[str, str],
                 streams: Streams) -> None:
        self.status_code = 200
        self.background = None
        self.messages = messages
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in {**SSE_HEADERS, **headers}.items()]
        self._streams = streams
        self._task: asyncio.Task[None] | None = None
        self._ending: str | None = None  # why this stream is being stopped from outside
        self.sending_since: float | None = None  # a send under way began then

    def stop(self, why: str) -> None:
        """Stop the stream from outside (the client left, a send is stuck)."""
        if self._ending is None and self._task is not None:
            self._ending = why
            self._task.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start: Message = {"type": "http.response.start", "status": 200,
                          "headers": self.raw_headers}
        if scope.get("method") == "HEAD":
            await self.messages.aclose()
            await send(start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        self._task = asyncio.current_task()
        watcher = asyncio.create_task(self._watch(receive))
        self._streams.add(self)
        body = scope.get(SERVER_SEND, send)
        try:
            await send(start)
            async for message in self.messages:
                self.sending_since = time.monotonic()
                await body({"type": "http.response.body", "body": message, "more_body": True})
                self.sending_since = None
            await body({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if self._ending is None:
                raise  # cancelled by the server (shutting down): its business
            assert self._task is not None
            self._task.uncancel()
        finally:
            self._streams.discard(self)
            watcher.cancel()
            await self.messages.aclose()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.stop("the client left")


class Streams:
    """The open ``EventStream``s of a process, and the sweep that drops those whose send
    has been blocked for ``send_timeout_s`` (their client reads nothing)."""

    def __init__(self, send_timeout_s: float, sweep_s: float = 1.0) -> None:
        self.send_timeout_s = send_timeout_s
        self.sweep_s = sweep_s
        self._open: weakref.WeakSet[EventStream] = weakref.WeakSet()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def response(self, messages: AsyncGenerator[bytes, None],
                 headers: Mapping[str, str]) -> EventStream:
        return EventStream(messages, headers, self)

    def add(self, stream: EventStream) -> None:
        self._open.add(stream)

    def discard(self, stream: EventStream) -> None:
        self._open.discard(stream)

    def sweep(self) -> None:
        now = time.monotonic()
        for stream in list(self._open):
            since = stream.sending_since
            if since is not None and now - since > self.send_timeout_s:
                log.warning("dropping a stream whose client has read nothing for %.0f s",
                            now - since)
                stream.stop("a send was stuck")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="event-streams")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_s)
            self.sweep()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
