"""Bytes <-> events, and the position of a record in the log."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from schemas import EVENT_ADAPTER, Event


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
    return event.model_dump_json().encode()


def decode(data: bytes | None) -> Event:
    if data is None:
        raise DecodeError("empty record value")
    try:
        return EVENT_ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise DecodeError(_summarise(exc)) from exc


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def key_of(event: Event) -> bytes:
    return str(event.conversation_id).encode()
