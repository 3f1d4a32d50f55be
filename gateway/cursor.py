"""What one client has been sent of one turn: stream items in (``schemas.live``), OpenAI
chunks out, each once.

Every chunk that stands for an entry of the log carries its position: in its JSON as
``event_id`` (an extra field, as the Responses stream carries ``sequence_number``), and,
on streams an ``EventSource`` reads, as its SSE ``id`` line too. A client that comes
back with that position as ``Last-Event-ID`` gets a cursor restored from the item
there (the last one it received), then the items after it: no gap, no duplicate, on
any gateway. No I/O.

* ``Start`` of the first attempt -> the role chunk; later attempts (a worker took the
  turn over) send nothing, the text carries on.
* ``Delta`` -> a content chunk; a ``seq`` already sent is a duplicate and dropped.
* ``End`` -> the finish chunk (and the usage chunk if asked for).
* ``Failure`` -> an error event in OpenAI's error shape.
"""

from __future__ import annotations

import json
from typing import Any

from gateway import openai_api
from gateway.errors import api_error
from gateway.ids import event_id
from gateway.problems import GenerationFailure, InvalidLastEventId
from gateway.subscription import Delivered
from schemas.live import TERMINAL, Delta, End, Failure, Start

# Failures caused by the request itself; the client gets a 400 for them.
CLIENT_FAILURES = {"context_length_exceeded", "invalid_sampling_params", "invalid_request",
                   "model_not_served"}


# Sent when a stream has had nothing to send for a while (a comment line: readers skip it).
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def frame(data: str, id_line: str | None = None) -> bytes:
    """One SSE message as ``vllm serve`` frames it: a ``data:`` line (JSON has no line
    breaks), an ``id:`` line before it if given, LF line ends, a blank line after."""
    if id_line is None:
        return f"data: {data}\n\n".encode()
    return f"id: {id_line}\ndata: {data}\n\n".encode()


def position_id(delivered: Delivered | None) -> str | None:
    """The SSE event id of what ``delivered`` stands for (None: it stands for no entry)."""
    if delivered is None or delivered.position is None:
        return None
    return event_id(delivered.position.partition, delivered.position.offset, delivered.index)


def sse(payload: dict[str, Any], delivered: Delivered | None = None,
        id_line: bool = False) -> bytes:
    """One SSE message; ``delivered``: the log entry it stands for, whose position it
    carries as ``event_id`` in its JSON (and as its ``id`` line with ``id_line``)."""
    position = position_id(delivered)
    if position is None:
        return frame(_json(payload))
    return frame(_json({**payload, "event_id": position}), position if id_line else None)


def failure(item: Failure) -> GenerationFailure:
    return GenerationFailure(item.code, item.message, item.code in CLIENT_FAILURES)


class Cursor:
    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool,
                 resume_after: tuple[str, int, int] | None = None,
                 id_lines: bool = False) -> None:
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        # Where the last item the client has is (``Delivered.key``).
        self.resume_after = resume_after
        self.id_lines = id_lines  # SSE id lines as well (for EventSource)
        self.next_seq = 0
        self.role_sent = False
        self.done = False
        # A content chunk is most of a stream: its JSON is this turn's fixed parts around
        # the text and the position (what ``_chunk`` and ``sse`` would give, built once).
        head = _json(openai_api.chunk(completion_id, created, model, {"content": ""}))
        before, after = head.split('"content":""', 1)
        self._content = (before + '"content":', after[:-1] + ',"event_id":"')

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return openai_api.chunk(self.completion_id, self.created, self.model, delta, finish)

    def _sse(self, payload: dict[str, Any], item: Delivered) -> bytes:
        return sse(payload, item, self.id_lines)

    def _content_frame(self, text: str, item: Delivered) -> bytes:
        position = position_id(item)
        if position is None:
            return self._sse(self._chunk({"content": text}), item)
        before, after = self._content
        return frame(f'{before}{_json(text)}{after}{position}"}}',
                     position if self.id_lines else None)

    def _restore(self, item: Delivered) -> None:
        """The client received ``item`` last: take up the state it implies."""
        self.role_sent = True
        if isinstance(item.item, Delta):
            self.next_seq = item.item.seq + item.span
        self.done = isinstance(item.item, TERMINAL)

    def feed(self, item: Delivered) -> list[bytes]:
        """The SSE events this stream item means for the client (often none)."""
        if self.resume_after is not None:
            key = item.key
            if key is None or key[0] != self.resume_after[0] or key < self.resume_after:
                return []
            if key > self.resume_after:
                raise InvalidLastEventId()
            if isinstance(item.item, Start) and item.item.attempt > 0:
                # No chunk carries a later attempt's start, so no client holds its id.
                raise InvalidLastEventId()
            self.resume_after = None
            self._restore(item)
            return []
        if self.done:
            return []
        event = item.item
        if isinstance(event, Start):
            if self.role_sent:
                return []
            self.role_sent = True
            return [self._sse(self._chunk({"role": "assistant", "content": ""}), item)]
        if isinstance(event, Delta):
            if event.seq < self.next_seq:
                return []  # a duplicate (a worker that lost the turn wrote it again)
            self.next_seq = event.seq + item.span
            if not event.text:
                return []
            if self.role_sent:
                return [self._content_frame(event.text, item)]
            self.role_sent = True
            return [self._sse(self._chunk({"role": "assistant", "content": event.text}), item)]
        self.done = True
        if isinstance(event, End):
            reason = openai_api.finish_reason_json(event.finish_reason)
            out = [self._sse(self._chunk({}, reason), item)]
            if self.include_usage:
                out.append(sse(openai_api.usage_chunk(self.completion_id, self.created,
                                                      self.model, event.usage)))
            return out
        return [self._sse(api_error(failure(event)).body(), item)]


def next_seq(items: list[Delivered]) -> int:
    """The ``seq`` that follows the deltas among ``items`` (0: none)."""
    return max((d.item.seq + d.span for d in items if isinstance(d.item, Delta)), default=0)


class Seqs:
    """Where a client's stream of a turn stands: the ``seq`` its next delta has (the
    count of deltas it got), known once it is past the item it resumes after."""

    def __init__(self, resume_after: tuple[str, int, int] | None) -> None:
        self.resume_after = resume_after
        self.next = 0

    def passed(self, delivered: Delivered) -> None:
        """``delivered`` went on to the client (or, before the resume point, was read)."""
        item = delivered.item
        if self.resume_after is not None:
            if delivered.key != self.resume_after:
                return
            self.resume_after = None
        if isinstance(item, Delta):
            self.next = max(self.next, item.seq + delivered.span)

    def missed(self, delivered: Delivered) -> bool:
        """Whether deltas come before ``delivered`` that the client has not got."""
        if self.resume_after is not None:
            return False
        item = delivered.item
        if isinstance(item, Delta):
            return item.seq > self.next
        return isinstance(item, End) and item.deltas > self.next

    def after_gap(self, delivered: Delivered) -> bool:
        """Whether ``delivered``, read again from the log, is one the client has not got:
        a delta from ``next`` on, or the turn's end (a start it has had, or needs not)."""
        item = delivered.item
        return isinstance(item, TERMINAL) or (isinstance(item, Delta) and item.seq >= self.next)
