"""Bytes <-> events, and the position of a record in the log."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from schemas import EVENT_ADAPTER, Event
from schemas.live import LIVE_ADAPTER, LiveBatch
from schemas.versions import is_current, upcast

# A topic and one of its partitions.
TP = tuple[str, int]


@dataclass(frozen=True, order=True)
class Position:
    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


class DecodeError(ValueError):
    """A record that is not a valid event. It goes to the dead-letter topic."""


def encode(event: Event) -> bytes:
    """The event as its record's value: JSON, fields that are None left out (a reader
    takes them as None: every such field defaults to it)."""
    return event.model_dump_json(exclude_none=True).encode()


def decode(data: bytes | None) -> Event:
    """The event in a record's value. Fields this code does not know are kept; an event
    older than its type's current version is upcast (``schemas.versions``)."""
    if data is None:
        raise DecodeError("empty record value")
    try:
        event: Event = EVENT_ADAPTER.validate_json(data)
    except ValidationError as exc:
        first_error: ValidationError | None = exc
    else:
        if is_current(event.type, event.v):
            return event
        first_error = None
    try:  # an older version: bring its JSON up to date, then validate that
        raw = json.loads(data)
        return EVENT_ADAPTER.validate_python(upcast(raw) if isinstance(raw, dict) else raw)
    except ValidationError as exc:
        raise DecodeError(_summarise(first_error or exc)) from exc
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"not an event: {exc}") from None



def decode_or_none(data: bytes | None) -> Event | None:
    """The event in a record's value, or None if it holds none (for readers that pass
    such records over: the consumer whose record it is dead-letters it)."""
    try:
        return decode(data)
    except DecodeError:
        return None


def decode_live(data: bytes | None) -> LiveBatch:
    """The ``LiveBatch`` in a ``chat.live`` record's value."""
    if data is None:
        raise DecodeError("empty record value")
    try:
        return LIVE_ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise DecodeError(_summarise(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"not a live batch: {exc}") from None


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def conversation_key(conversation_id: uuid.UUID) -> bytes:
    """The record key of a conversation's events in every chat topic."""
    return str(conversation_id).encode()


def key_of(event: Event) -> bytes:
    return conversation_key(event.conversation_id)
