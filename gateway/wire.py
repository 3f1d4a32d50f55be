"""The wire format of a followed turn: OpenAI's chat completion chunks as server-sent
events, or one chat completion for a client that waits for the whole reply.

``gateway.follow`` deals in turns and their items (``schemas.live``); this module is where
they become bytes a client reads, and where a problem met mid-stream becomes an OpenAI
error body in the stream (the status line went out with the first byte).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from gateway import openai_api
from gateway.cursor import DONE, KEEPALIVE, Cursor, sse
from gateway.errors import api_error
from gateway.follow import Follow, Following
from gateway.problems import Problem, StreamLagging
from gateway.subscription import Overflow


async def sse_stream(follow: Follow, f: Following, include_usage: bool,
                     id_lines: bool = False) -> AsyncGenerator[bytes, None]:
    """The turn as SSE messages of OpenAI chunks, ending with ``[DONE]``; with
    ``id_lines``, each message that stands for a log event has an ``id`` line (what an
    EventSource sends back as ``Last-Event-ID``). A comment line keeps a quiet stream
    alive (``KEEPALIVE``)."""
    cursor = Cursor(f.completion_id, f.created, f.model, include_usage, f.resume_after,
                    id_lines)
    complete = True
    async with follow.following(f) as items:
        try:
            async for item in items:
                if item is None:
                    yield KEEPALIVE
                    continue
                for out in cursor.feed(item):
                    yield out
                if cursor.done:
                    break
        except Problem as exc:
            yield sse(api_error(exc).body())
        except Overflow:
            complete = False  # the client reconnects with its Last-Event-ID
            yield sse(api_error(StreamLagging(
                "The stream fell too far behind and was dropped; reconnect with "
                "Last-Event-ID to continue.")).body())
    if complete:
        yield DONE


async def completion(follow: Follow, f: Following) -> dict[str, Any]:
    """The whole reply as one OpenAI chat completion (``Problem`` if the turn failed or
    timed out)."""
    reply = await follow.collect(f)
    return openai_api.completion(f.completion_id, f.created, f.model, reply.text,
                                 reply.finish_reason, reply.usage)
