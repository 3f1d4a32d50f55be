"""What each event means for the conversation store: a pure function, no I/O.

``project(event)`` returns the SQL writes for one event. Every write is an
idempotent upsert whose result does not depend on the order in which the two
topics are read, so replaying the log, or re-applying part of it, gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from schemas import (
    ClientAttached,
    ClientDetached,
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    MemoryForgotten,
    PromptSubmitted,
    SessionCreated,
    SessionDeleted,
    TokenDelta,
)
from schemas.conversation import Verdict, ended_status, storable, title


@dataclass(frozen=True)
class Write:
    sql: str
    params: tuple[Any, ...] | dict[str, Any]


def _storable_value(value: Any) -> Any:
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, Jsonb):
        return Jsonb(_storable_value(value.obj))
    if isinstance(value, dict):
        return {storable(k): _storable_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_storable_value(v) for v in value)
    return value


def write(sql: str, params: tuple[Any, ...] | dict[str, Any]) -> Write:
    """A write whose every text, in JSON too, is stored by the one rule (``storable``),
    whichever producer wrote the event."""
    return Write(sql, _storable_value(params))

# An event of another tenant than its conversation's changes nothing of it (one that
# would add a turn is refused outright, by the turn's foreign key). A session's own
# title wins over the one its first message gives, whichever topic is read first (a
# replay reads chat.control and chat.prompts in no set order between them).
_UPSERT = """
INSERT INTO conversations (id, tenant, title, created_at, updated_at, memory_user)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (id) DO UPDATE SET
    title = CASE WHEN conversations.deleted THEN NULL
                 ELSE COALESCE({first}.title, {then}.title) END,
    memory_user = CASE WHEN conversations.deleted THEN NULL
                       ELSE COALESCE(conversations.memory_user, EXCLUDED.memory_user) END,
    created_at = LEAST(conversations.created_at, EXCLUDED.created_at),
    updated_at = GREATEST(conversations.updated_at, EXCLUDED.updated_at)
WHERE conversations.tenant = EXCLUDED.tenant
"""
_UPSERT_CONVERSATION = _UPSERT.format(first="conversations", then="EXCLUDED")
_UPSERT_SESSION = _UPSERT.format(first="EXCLUDED", then="conversations")

# A deleted session takes no more messages, whichever topic is read first.
_INSERT_MESSAGE = """
INSERT INTO messages (conversation_id, seq, role, content, request_id, created_at)
SELECT %(conv)s, %(seq)s, %(role)s, %(content)s, %(request_id)s, %(at)s
WHERE NOT EXISTS (SELECT 1 FROM conversations
                  WHERE id = %(conv)s AND (deleted OR tenant <> %(tenant)s))
ON CONFLICT (conversation_id, seq) DO NOTHING
"""

_DELETE_CONVERSATION = """
INSERT INTO conversations (id, tenant, title, created_at, updated_at, deleted)
VALUES (%s, %s, NULL, %s, %s, true)
ON CONFLICT (id) DO UPDATE SET
    deleted = true,
    title = NULL,
    memory_user = NULL,
    updated_at = GREATEST(conversations.updated_at, EXCLUDED.updated_at)
WHERE conversations.tenant = EXCLUDED.tenant
"""

_DELETE_MESSAGES = """
DELETE FROM messages WHERE conversation_id = %s
    AND EXISTS (SELECT 1 FROM conversations WHERE id = %s AND deleted)
"""

# What else of a deleted conversation's turns a client said: the end users they named,
# their sampling (stop strings) and idempotency keys' digests.
_DELETE_USERS = """
DELETE FROM conversation_users WHERE conversation_id = %s
    AND EXISTS (SELECT 1 FROM conversations WHERE id = %s AND deleted)
"""
_FORGET_TURNS = """
UPDATE generations SET sampling = NULL, idempotency_key = NULL WHERE conversation_id = %s
    AND (sampling IS NOT NULL OR idempotency_key IS NOT NULL)
    AND EXISTS (SELECT 1 FROM conversations WHERE id = %s AND deleted)
"""

# An end user a turn named, unless its conversation is deleted already.
_NAMED_USER = """
INSERT INTO conversation_users (conversation_id, tenant, "user")
SELECT %(conv)s, %(tenant)s, %(user)s
WHERE EXISTS (SELECT 1 FROM conversations WHERE id = %(conv)s AND NOT deleted
              AND tenant = %(tenant)s)
ON CONFLICT DO NOTHING
"""

# A duplicate prompt (an idempotent retry) keeps the first one's position.
_PROMPT_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, model, sampling, status,
    submitted_at, idempotency_key, background, prompt_offset, charge_key, charge_tokens)
SELECT %(rid)s, %(conv)s, %(tenant)s, %(model)s, CASE WHEN deleted THEN NULL ELSE
       %(sampling)s END, 'pending', %(at)s, CASE WHEN deleted THEN NULL ELSE %(key)s END,
       %(background)s, %(offset)s, %(charge_key)s, %(charge_tokens)s
  FROM (SELECT EXISTS (SELECT 1 FROM conversations WHERE id = %(conv)s AND deleted)
        AS deleted) AS conversation
ON CONFLICT (request_id) DO UPDATE SET
    charge_key = COALESCE(generations.charge_key, EXCLUDED.charge_key),
    charge_tokens = CASE WHEN generations.charge_key IS NULL THEN EXCLUDED.charge_tokens
                         ELSE generations.charge_tokens END,
    model = EXCLUDED.model,
    sampling = EXCLUDED.sampling,
    submitted_at = EXCLUDED.submitted_at,
    idempotency_key = EXCLUDED.idempotency_key,
    background = EXCLUDED.background,
    prompt_offset = COALESCE(generations.prompt_offset, EXCLUDED.prompt_offset)
"""

_STARTED_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, status, attempt, worker,
    prompt_tokens, started_at)
VALUES (%s, %s, %s, 'running', %s, %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
    started_at = LEAST(COALESCE(generations.started_at, EXCLUDED.started_at),
                       EXCLUDED.started_at),
    status = CASE WHEN generations.status = 'pending' THEN 'running' ELSE generations.status END,
    attempt = GREATEST(generations.attempt, EXCLUDED.attempt),
    worker = CASE WHEN EXCLUDED.attempt >= generations.attempt
                  THEN EXCLUDED.worker ELSE generations.worker END,
    prompt_tokens = COALESCE(generations.prompt_tokens, EXCLUDED.prompt_tokens)
"""

# A turn's end offset is its first end's (the one whose reply the store keeps).
_FINISHED_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, status, finish_reason,
    prompt_tokens, completion_tokens, ttft_ms, duration_ms, attempt, finished_at, end_offset)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
    end_offset = COALESCE(generations.end_offset, EXCLUDED.end_offset),
    status = EXCLUDED.status,
    finish_reason = EXCLUDED.finish_reason,
    prompt_tokens = EXCLUDED.prompt_tokens,
    completion_tokens = EXCLUDED.completion_tokens,
    ttft_ms = EXCLUDED.ttft_ms,
    duration_ms = EXCLUDED.duration_ms,
    attempt = GREATEST(generations.attempt, EXCLUDED.attempt),
    finished_at = EXCLUDED.finished_at
"""

_FAILED_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, status, attempt,
    error_code, error_message, finished_at, end_offset)
VALUES (%s, %s, %s, 'failed', %s, %s, %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
    end_offset = COALESCE(generations.end_offset, EXCLUDED.end_offset),
    status = 'failed',
    attempt = GREATEST(generations.attempt, EXCLUDED.attempt),
    error_code = EXCLUDED.error_code,
    error_message = EXCLUDED.error_message,
    finished_at = EXCLUDED.finished_at
"""


# A turn's charge against its key's rate limit, trued up to its usage once both its
# prompt and its end are stored (whichever came second), and once only.
_TRUE_UP = """
WITH turn AS (
    SELECT request_id, charge_key,
           COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0) - charge_tokens AS owed
      FROM generations
     WHERE request_id = %s AND charge_tokens IS NOT NULL AND finished_at IS NOT NULL
       FOR UPDATE
), settled AS (
    UPDATE generations g SET charge_tokens = NULL FROM turn
     WHERE g.request_id = turn.request_id
    RETURNING turn.charge_key, turn.owed
)
SELECT true_up_bucket(charge_key, owed) FROM settled
"""


def _title(event: Event) -> str | None:
    if isinstance(event, SessionCreated):
        return title(event.title)
    if isinstance(event, PromptSubmitted) and not event.history_len:
        return title(next((m.content for m in event.messages if m.role == "user"), ""))
    return None


def _message(event: Event, seq: int, role: str, content: str) -> Write:
    return write(_INSERT_MESSAGE, {"conv": event.conversation_id, "seq": seq, "role": role,
                                   "content": content, "request_id": event.request_id,
                                   "at": event.occurred_at, "tenant": event.tenant})


def project(event: Event, offset: int | None = None,
            verdict: Verdict = Verdict.ACCEPTED) -> list[Write]:
    """The writes that make the store reflect ``event``, found at ``offset`` of its topic.
    A prompt's ``verdict`` comes from ``schemas.conversation.TurnLedger``."""
    if isinstance(event, (TokenDelta, ClientAttached, ClientDetached, MemoryForgotten)):
        # deltas live in the log (the store keeps whole messages); so do attachments;
        # memories are the memory service's
        return []
    if isinstance(event, PromptSubmitted) and verdict is Verdict.VOID:
        return []  # a void prompt is never run and never stored
    at = event.occurred_at
    conv = event.conversation_id
    if isinstance(event, SessionDeleted):
        return [write(_DELETE_CONVERSATION, (conv, event.tenant, at, at)),
                write(_DELETE_MESSAGES, (conv, conv)), write(_DELETE_USERS, (conv, conv)),
                write(_FORGET_TURNS, (conv, conv))]
    memory_user = event.memory_user if isinstance(event, SessionCreated) else None
    upsert = _UPSERT_SESSION if isinstance(event, SessionCreated) else _UPSERT_CONVERSATION
    writes = [write(upsert, (conv, event.tenant, _title(event), at, at, memory_user))]
    if memory_user is not None:
        writes.append(write(_NAMED_USER, {"conv": conv, "tenant": event.tenant,
                                          "user": memory_user}))
    if isinstance(event, PromptSubmitted):
        for seq, msg in enumerate(event.messages, start=event.history_len):
            writes.append(_message(event, seq, msg.role, msg.content))
        writes.append(
            write(
                _PROMPT_GENERATION,
                {"rid": event.request_id, "conv": conv, "tenant": event.tenant,
                 "model": event.model, "sampling": Jsonb(event.sampling.model_dump(
                     mode="json")), "at": at, "key": event.idempotency_key,
                 "background": event.background, "offset": offset,
                 "charge_key": event.charge.key_id if event.charge else None,
                 "charge_tokens": event.charge.tokens if event.charge else None},
            )
        )
        if event.user is not None:
            writes.append(write(_NAMED_USER, {"conv": conv, "tenant": event.tenant,
                                              "user": event.user}))
        if event.charge is not None:
            writes.append(write(_TRUE_UP, (event.request_id,)))
    elif isinstance(event, GenerationStarted):
        writes.append(
            write(
                _STARTED_GENERATION,
                (event.request_id, conv, event.tenant, event.attempt, event.worker,
                 event.prompt_tokens, at),
            )
        )
    elif isinstance(event, GenerationFinished):
        status = ended_status(event.finish_reason)
        writes.append(_message(event, event.reply_seq, "assistant", event.text))
        writes.append(
            write(
                _FINISHED_GENERATION,
                (event.request_id, conv, event.tenant, status, event.finish_reason,
                 event.usage.prompt_tokens, event.usage.completion_tokens, event.ttft_ms,
                 event.duration_ms, event.attempt, at, offset),
            )
        )
        writes.append(write(_TRUE_UP, (event.request_id,)))
    elif isinstance(event, GenerationFailed):
        writes.append(
            write(
                _FAILED_GENERATION,
                (event.request_id, conv, event.tenant, event.attempt, event.code,
                 event.message, at, offset),
            )
        )
        writes.append(write(_TRUE_UP, (event.request_id,)))
    # GenerationCancelled asks to stop; the worker's GenerationFinished(abort) records the
    # outcome. SessionCreated only makes the conversation row.
    return writes
