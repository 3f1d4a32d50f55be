"""Bytes <-> events, and the position of a record in the log."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeVar

import msgspec
from pydantic import ValidationError

from pipeline import sealing
from pipeline.retry import Backoff
from schemas import EVENT_ADAPTER, Event
from schemas.content import content_of, with_content, without_content
from schemas.events import Sealed
from schemas.live import LIVE_ADAPTER, LiveBatch
from schemas.versions import is_current, upcast

log = logging.getLogger(__name__)
# A topic and one of its partitions.
TP = tuple[str, int]
T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Position:
    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}@{self.offset}"


class DecodeError(ValueError):
    """A record that is not a valid event. It goes to the dead-letter topic."""


class _Held:
    """``Codec.encode``'s default: the key a keyring holds for the event's conversation."""


HELD = _Held()
# What ``Codec.encode`` seals an event's content with: a key, ``"erased"`` (the content
# is dropped), None (it is written in the clear), or the key held (``HELD``).
SealWith = sealing.DataKey | Literal["erased"] | None


class _SealedRef(msgspec.Struct):
    key: str


class _SealedOf(msgspec.Struct):
    """What ``sealed_key`` reads of an event: every other field is passed over."""

    sealed: _SealedRef | None = None
    occurred_at: datetime | None = None
    model: str | None = None


_sealed_of = msgspec.json.Decoder(_SealedOf)
# What msgspec raises for bytes that hold no value of a decoder's type: RecursionError
# for nesting deeper than it follows (a record on a topic is anyone's bytes).
_UNREADABLE = (msgspec.DecodeError, RecursionError)

_json = msgspec.json.Encoder()
_content = msgspec.json.Decoder(dict)
_live_texts = msgspec.json.Decoder(list[tuple[str, tuple[int, ...]]])


class Codec:
    """Events to bytes and back, with a conversation's content sealed and opened through
    ``cipher`` (``pipeline.sealing``): each reader and writer is given the codec of its
    process's keyring, as it is given its producer. ``CLEAR``'s cipher holds no keys:
    it writes content in the clear and reads sealed content as erased."""

    __slots__ = ("cipher",)

    def __init__(self, cipher: sealing.Cipher = sealing.CLEAR) -> None:
        self.cipher = cipher

    def __repr__(self) -> str:
        return f"Codec({self.cipher!r})"

    # -- writing -------------------------------------------------------------------
    def encode(self, event: Event, key: SealWith | _Held = HELD) -> bytes:
        """The event as its record's value (see ``bare``), its content sealed with
        ``key``: by default the one the cipher's keyrings hold for its conversation
        (none: in the clear), dropped if that conversation's keys were destroyed. A
        writer that knows its conversation's key names it: a keyring holds a bounded
        number."""
        if event.sealed is None and (self.cipher or not isinstance(key, _Held)):
            content = content_of(event)
            if content is not None:
                if isinstance(key, _Held):
                    key = self.cipher.writing_key(event.conversation_id)
                elif isinstance(key, sealing.DataKey):
                    if key.conversation_id != event.conversation_id:
                        raise ValueError(f"key {key.key_id} is not the key of "
                                         f"conversation {event.conversation_id}")
                    if self.cipher.revoked(event.conversation_id):
                        key = "erased"
                if isinstance(key, sealing.DataKey):
                    box = sealing.seal(key, _json.encode(content))
                    event = without_content(event, Sealed(key=key.key_id, box=box))  # type: ignore[assignment]
                elif key is not None:  # its keys were destroyed: not written
                    event = without_content(event, Sealed(key=sealing.ERASED, box=""))  # type: ignore[assignment]
        return _dumped(event)

    # -- reading -------------------------------------------------------------------
    def decode(self, data: bytes | None) -> Event:
        """The event in a record's value (see ``parse``), its sealed content opened if
        the cipher holds the key; on a thread that runs an event loop,
        ``decode_async`` does what this cannot there: wait for a key not held yet."""
        return self.decode_keyed(data)[0]

    def decode_keyed(self, data: bytes | None, opens: Callable[[Event], bool] | None = None
                     ) -> tuple[Event, sealing.DataKey | None]:
        """``decode``, and the key its content was opened with (None: it was in the
        clear, or erased): the key a writer of the same conversation's content seals
        with. ``opens``: whether the event's content is wanted; one it says not is left
        sealed, as ``parse`` gives it, and no key is looked up for it."""
        event = parse(data)
        if event.sealed is None or (opens is not None and not opens(event)):
            return event, None
        return self._opened(event)

    def _opened(self, event: Event) -> tuple[Event, sealing.DataKey | None]:
        """``event`` with its sealed content opened, and the key that opened it, if the
        cipher holds it; else as it is (content empty, ``sealed`` set: erased)."""
        assert event.sealed is not None
        key = self.cipher.reading_key(event.sealed.key, event.occurred_at.timestamp())
        if key is None:
            return event, None
        if key.conversation_id != event.conversation_id:
            raise DecodeError(f"sealed with key {key.key_id} of another conversation")
        try:
            content = _content.decode(sealing.unseal(key, event.sealed.box))
        except (sealing.Unreadable, *_UNREADABLE) as exc:
            raise DecodeError(str(exc)) from None
        return with_content(event, content, None), key  # type: ignore[return-value]

    def decode_live(self, data: bytes | None) -> LiveBatch:
        """The ``LiveBatch`` in a ``chat.live`` record's value, its sealed text opened
        where the cipher holds the keys (``parse_live`` and ``open_live``: only the
        turns a reader wants)."""
        batch = parse_live(data)
        return self.open_live(batch) if batch.sealed else batch

    def open_live(self, batch: LiveBatch, wanted: Container[int] | None = None
                  ) -> LiveBatch:
        """``batch`` with the sealed text of each turn (of the ``wanted`` refs, or all)
        whose key the cipher holds put back in its deltas (see ``schemas.live``); the
        others' stay empty."""
        opened: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
        for ref, key_id, box in batch.sealed:
            if wanted is not None and ref not in wanted:
                continue
            key = self.cipher.reading_key(key_id, batch.at / 1000)
            if key is None:
                continue
            try:
                opened[ref] = _live_texts.decode(sealing.unseal(key, box))
            except (sealing.Unreadable, *_UNREADABLE) as exc:
                raise DecodeError(str(exc)) from None
        if not opened:
            return batch
        taken = dict.fromkeys(opened, 0)
        deltas = []
        for ref, seq, text, token_ids in batch.deltas:
            texts = opened.get(ref)
            if texts is not None and taken[ref] < len(texts):
                text, token_ids = texts[taken[ref]]
                taken[ref] += 1
            deltas.append((ref, seq, text, token_ids))
        return batch.model_copy(update={"deltas": tuple(deltas), "sealed": tuple(
            s for s in batch.sealed if s[0] not in opened)})

    # -- reading, in a coroutine ---------------------------------------------------
    async def decode_async(self, data: bytes | None) -> Event:
        """``decode`` for a coroutine: a key not held yet is looked for on a thread (the
        loop's other tasks go on meanwhile), and while the key topic cannot be read,
        asked for again until it can (bound the wait where an answer is due)."""
        return await self._unblocked(self.decode, data)

    async def decode_keyed_async(self, data: bytes | None,
                                 opens: Callable[[Event], bool] | None = None
                                 ) -> tuple[Event, sealing.DataKey | None]:
        """``decode_keyed`` for a coroutine (see ``decode_async``)."""
        return await self._unblocked(self.decode_keyed, data, opens)

    async def decode_live_async(self, data: bytes | None) -> LiveBatch:
        """``decode_live`` for a coroutine (see ``decode_async``)."""
        return await self._unblocked(self.decode_live, data)

    async def open_live_async(self, batch: LiveBatch,
                              wanted: Container[int] | None = None) -> LiveBatch:
        """``open_live`` for a coroutine (see ``decode_async``)."""
        return await self._unblocked(self.open_live, batch, wanted)

    async def _unblocked(self, call: Callable[..., T], *args: object) -> T:
        backoff = Backoff(0.1, 5.0)
        looked_up: dict[str, sealing.DataKey | None] = {}  # used by ``call`` from then on
        while True:
            token = sealing.LOOKED_UP.set(looked_up)
            try:
                return call(*args)
            except sealing.KeyNotHeld as exc:
                miss = exc
            finally:
                sealing.LOOKED_UP.reset(token)  # for this call alone
            try:  # the key, or None if it is gone (or it raises)
                looked_up[miss.key_id] = await sealing.looked_up(
                    self.cipher.reading_key, miss.key_id, miss.written_at)
            except sealing.RingUnavailable as exc:
                if not exc.unreachable:
                    raise
                pause = backoff.next()
                log.warning("data key %s not readable yet, asking again in %.1f s: %s",
                            miss.key_id, pause, exc)
                await asyncio.sleep(pause)


# Holds no keys: writes content in the clear, reads sealed content as erased (benches,
# tools that read ids and counts only, and readers that never open content).
CLEAR = Codec()


def bare(event: Event) -> bytes:
    """The event as its record's value: JSON, fields that are None left out (a reader
    takes them as None: every such field defaults to it), and those of
    ``OMITTED_EMPTY`` while empty. Only for an event with no content, or content sealed
    already: content is encoded by a ``Codec`` (``ValueError`` otherwise), so that no
    writer puts it in the clear without saying so (``CLEAR.encode``)."""
    if event.sealed is None and content_of(event) is not None:
        raise ValueError(f"a {event.type} event carries content: a Codec encodes it")
    return _dumped(event)


def _dumped(event: Event) -> bytes:
    empty = {name for name in event.OMITTED_EMPTY if not getattr(event, name)}
    return event.model_dump_json(exclude_none=True, exclude=empty or None).encode()


def sealed_key(data: bytes | None, model: str | None = None
               ) -> tuple[str, float | None] | None:
    """The key a record's sealed content names, and when the event was written (seconds
    since the epoch), read without decoding the rest of it: None if its content is in the
    clear, it is not an event (``decode`` says why), or, ``model`` given, it names another
    model (a prompt some other worker runs)."""
    if not data:
        return None
    try:
        found = _sealed_of.decode(data)
    except _UNREADABLE:
        return None
    if found.sealed is None or (model is not None and found.model != model):
        return None
    at = found.occurred_at
    return found.sealed.key, at.timestamp() if at is not None else None


def names_model(data: bytes | None, model: str) -> bool:
    """Whether a record's event names ``model`` (a prompt that model's workers run), read
    without decoding the rest of it: not if it is not an event."""
    if not data:
        return False
    try:
        return _sealed_of.decode(data).model == model
    except _UNREADABLE:
        return False


def parse(data: bytes | None) -> Event:
    """The event in a record's value, its sealed content, if any, left sealed (content
    empty, ``sealed`` set). Fields this code does not know are kept; an event older than
    its type's current version is upcast (``schemas.versions``)."""
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
        raise DecodeError(summarise(first_error or exc)) from exc
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"not an event: {exc}") from None


def parse_or_none(data: bytes | None) -> Event | None:
    """``parse``, or None if the record holds no event (for readers that pass such
    records over: the consumer whose record it is dead-letters it)."""
    try:
        return parse(data)
    except DecodeError:
        return None


def parse_live(data: bytes | None) -> LiveBatch:
    """The ``LiveBatch`` in a ``chat.live`` record's value, its sealed text left sealed."""
    if data is None:
        raise DecodeError("empty record value")
    try:
        return LIVE_ADAPTER.validate_json(data)
    except ValidationError as exc:
        raise DecodeError(summarise(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"not a live batch: {exc}") from None


def summarise(exc: ValidationError) -> str:
    """A refusal's first errors on one line, without the input they quote."""
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
