"""The ids clients hold, and what they tell any gateway process.

* A completion id is ``chatcmpl-<conversation hex><16 hex>``: it names its conversation,
  so any gateway knows which partition holds the turn without asking anyone.
* With an ``Idempotency-Key`` the id (and, for a new session, the conversation) is
  derived from the tenant and the key, so a retry names the same turn.
* An SSE event id is ``<partition>-<offset>``: the event's position in
  ``chat.generations``, which a client sends back as ``Last-Event-ID`` to resume.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid

from gateway.problems import CompletionNotFound, InvalidLastEventId

PREFIX = "chatcmpl-"
_COMPLETION = re.compile(r"chatcmpl-([0-9a-f]{32})([0-9a-f]{16})")
_EVENT_ID = re.compile(r"(\d{1,9})-(\d{1,19})")


def _digest(tenant: str, key: str) -> bytes:
    return hashlib.sha256(f"{tenant}\0{key}".encode()).digest()


def idempotent_conversation(tenant: str, key: str) -> uuid.UUID:
    """The conversation a keyed request without a session starts (the same on every retry)."""
    return uuid.UUID(bytes=_digest(tenant, key)[:16], version=4)


def completion_id(conversation_id: uuid.UUID, tenant: str = "", key: str | None = None) -> str:
    suffix = _digest(tenant, key)[16:24].hex() if key is not None else secrets.token_hex(8)
    return f"{PREFIX}{conversation_id.hex}{suffix}"


def conversation_of(completion: str) -> uuid.UUID:
    """The conversation a completion id names (``CompletionNotFound`` for anything else)."""
    match = _COMPLETION.fullmatch(completion)
    if match is None:
        raise CompletionNotFound(completion)
    return uuid.UUID(hex=match.group(1))


def event_id(partition: int, offset: int) -> str:
    return f"{partition}-{offset}"


def parse_event_id(raw: str) -> tuple[int, int]:
    match = _EVENT_ID.fullmatch(raw.strip())
    if match is None:
        raise InvalidLastEventId(raw)
    return int(match.group(1)), int(match.group(2))
