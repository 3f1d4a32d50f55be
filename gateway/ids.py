"""The ids clients hold, and what they tell any gateway process.

* A completion id is ``chatcmpl-<conversation hex><16 hex>``: it names its conversation,
  so any gateway knows which partition holds the turn without asking anyone.
* With an ``Idempotency-Key`` the id (and, for a new session, the conversation) is
  derived from the key's keyed digest (``pipeline.digests``: the tenant and the key,
  keyed by the KEK), so a retry names the same turn and no id tells the key.
* An SSE event id is ``<partition>-<offset>-<index>``: the entry's position in
  ``chat.live`` (its record's offset, its index in the record), which a client sends
  back as ``Last-Event-ID`` to resume. ``<partition>-<offset>`` is a position in
  ``chat.generations``: a turn written before the live stream (its deltas are events
  there).
"""

from __future__ import annotations

import re
import secrets
import uuid

from gateway.problems import CompletionNotFound, InvalidLastEventId

PREFIX = "chatcmpl-"
_COMPLETION = re.compile(r"chatcmpl-([0-9a-f]{32})([0-9a-f]{16})")
_EVENT_ID = re.compile(r"(\d{1,9})-(\d{1,18})(?:-(\d{1,6}))?")
# A resume position: partition, offset, and the entry's index in a chat.live record
# (None: a position in chat.generations).
EventPosition = tuple[int, int, int | None]


def idempotent_conversation(key_digest: bytes) -> uuid.UUID:
    """The conversation a keyed request without a session starts (the same on every
    retry): from its idempotency key's digest (``Digester.raw("idempotency", ...)``)."""
    return uuid.UUID(bytes=key_digest[:16], version=4)


def completion_id(conversation_id: uuid.UUID, key_digest: bytes | None = None) -> str:
    suffix = key_digest[16:24].hex() if key_digest is not None else secrets.token_hex(8)
    return f"{PREFIX}{conversation_id.hex}{suffix}"


def conversation_of(completion: str) -> uuid.UUID:
    """The conversation a completion id names (``CompletionNotFound`` for anything else)."""
    match = _COMPLETION.fullmatch(completion)
    if match is None:
        raise CompletionNotFound(completion)
    return uuid.UUID(hex=match.group(1))


def event_id(partition: int, offset: int, index: int | None = None) -> str:
    return f"{partition}-{offset}" if index is None else f"{partition}-{offset}-{index}"


def parse_event_id(raw: str) -> EventPosition:
    match = _EVENT_ID.fullmatch(raw.strip())
    if match is None:
        raise InvalidLastEventId(raw)
    index = match.group(3)
    return int(match.group(1)), int(match.group(2)), None if index is None else int(index)
