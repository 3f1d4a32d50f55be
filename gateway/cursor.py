"""What one client has been sent of one turn: log events in, OpenAI chunks out, each once.

Every chunk that stands for a log event carries that event's position: in its JSON as
``event_id`` (an extra field, as the Responses stream carries ``sequence_number``), and,
on streams an ``EventSource`` reads, as its SSE ``id`` line too. A client that comes
back with that position as ``Last-Event-ID`` gets a cursor restored from the event
there (the last one it received), then the events after it: no gap, no duplicate, on
any gateway. No I/O.

* ``GenerationStarted`` of the first attempt -> the role chunk; later attempts
  (a worker took the turn over) send nothing, the text carries on.
* ``TokenDelta`` -> a content chunk; a ``seq`` already sent is a duplicate and dropped.
* ``GenerationFinished`` -> the finish chunk (and the usage chunk if asked for).
* ``GenerationFailed`` -> an error event in OpenAI's error shape.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway import openai_api
from gateway.errors import api_error
from gateway.ids import event_id
from gateway.problems import GenerationFailure, InvalidLastEventId
from gateway.tail import Delivered
from schemas import GenerationFailed, GenerationFinished, GenerationStarted, TokenDelta

log = logging.getLogger(__name__)

# Failures caused by the request itself; the client gets a 400 for them.
CLIENT_FAILURES = {"context_length_exceeded", "invalid_sampling_params", "invalid_request",
                   "model_not_served"}


def sse(payload: dict[str, Any], delivered: Delivered | None = None,
        id_line: bool = False) -> dict[str, Any]:
    """One SSE event; ``delivered``: the log event it stands for, whose position it
    carries as ``event_id`` in its JSON (and as its ``id`` line with ``id_line``)."""
    if delivered is None:
        return {"data": json.dumps(payload, separators=(",", ":"))}
    position = event_id(delivered.position.partition, delivered.position.offset)
    event: dict[str, Any] = {"data": json.dumps({**payload, "event_id": position},
                                                separators=(",", ":"))}
    if id_line:
        event["id"] = position
    return event


def failure(event: GenerationFailed) -> GenerationFailure:
    return GenerationFailure(event.code, event.message, event.code in CLIENT_FAILURES)


class Cursor:
    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool,
                 resume_after: int | None = None, id_lines: bool = False) -> None:
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.resume_after = resume_after  # the offset of the last event the client has
        self.id_lines = id_lines  # SSE id lines as well (for EventSource)
        self.next_seq = 0
        self.role_sent = False
        self.done = False

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return openai_api.chunk(self.completion_id, self.created, self.model, delta, finish)

    def _sse(self, payload: dict[str, Any], item: Delivered) -> dict[str, Any]:
        return sse(payload, item, self.id_lines)

    def _restore(self, item: Delivered) -> None:
        """The client received ``item`` last: take up the state it implies."""
        event = item.event
        self.role_sent = True
        if isinstance(event, TokenDelta):
            self.next_seq = event.seq + item.span
        self.done = isinstance(event, (GenerationFinished, GenerationFailed))

    def feed(self, item: Delivered) -> list[dict[str, Any]]:
        """The SSE events this log event means for the client (often none)."""
        if self.resume_after is not None:
            offset = item.position.offset
            if offset < self.resume_after:
                return []
            if offset > self.resume_after:
                raise InvalidLastEventId()
            if isinstance(item.event, GenerationStarted) and item.event.attempt > 0:
                # No chunk carries a later attempt's start, so no client holds its id.
                raise InvalidLastEventId()
            self.resume_after = None
            self._restore(item)
            return []
        if self.done:
            return []
        event = item.event
        if isinstance(event, GenerationStarted):
            if self.role_sent:
                return []
            self.role_sent = True
            return [self._sse(self._chunk({"role": "assistant", "content": ""}), item)]
        if isinstance(event, TokenDelta):
            if event.seq < self.next_seq:
                return []  # a duplicate (a worker that lost the turn wrote it again)
            if event.seq > self.next_seq:
                log.error("gap in %s: expected seq %d, got %d", self.completion_id,
                          self.next_seq, event.seq)
            self.next_seq = event.seq + item.span
            if not event.text:
                return []
            delta: dict[str, Any] = {"content": event.text}
            if not self.role_sent:
                self.role_sent = True
                delta = {"role": "assistant", **delta}
            return [self._sse(self._chunk(delta), item)]
        self.done = True
        if isinstance(event, GenerationFinished):
            reason = openai_api.FINISH_REASONS.get(event.finish_reason, "stop")
            out = [self._sse(self._chunk({}, reason), item)]
            if self.include_usage:
                out.append(sse(openai_api.usage_chunk(self.completion_id, self.created,
                                                      self.model, event.usage)))
            return out
        return [self._sse(api_error(failure(event)).body(), item)]
