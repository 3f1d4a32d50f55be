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
    Event,
    GenerationCancelled,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
)


@dataclass(frozen=True)
class Write:
    sql: str
    params: tuple[Any, ...]


TITLE_CHARS = 80


def storable(text: str) -> str:
    """Postgres text cannot hold NUL; the store shows it as U+FFFD (the log keeps it)."""
    return text.replace("\x00", "\ufffd")

_UPSERT_CONVERSATION = """
INSERT INTO conversations (id, tenant, title, created_at, updated_at)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (id) DO UPDATE SET
    title = COALESCE(conversations.title, EXCLUDED.title),
    created_at = LEAST(conversations.created_at, EXCLUDED.created_at),
    updated_at = GREATEST(conversations.updated_at, EXCLUDED.updated_at)
"""

_INSERT_MESSAGE = """
INSERT INTO messages (conversation_id, seq, role, content, request_id, created_at)
VALUES (%s, %s, %s, %s, %s, %s)
ON CONFLICT (conversation_id, seq) DO NOTHING
"""

_PROMPT_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, model, sampling, status, submitted_at)
VALUES (%s, %s, %s, %s, %s, 'pending', %s)
ON CONFLICT (request_id) DO UPDATE SET
    model = EXCLUDED.model,
    sampling = EXCLUDED.sampling,
    submitted_at = EXCLUDED.submitted_at
"""

_STARTED_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, status, attempt, worker,
    prompt_tokens)
VALUES (%s, %s, %s, 'running', %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
    status = CASE WHEN generations.status = 'pending' THEN 'running' ELSE generations.status END,
    attempt = GREATEST(generations.attempt, EXCLUDED.attempt),
    worker = CASE WHEN EXCLUDED.attempt >= generations.attempt
                  THEN EXCLUDED.worker ELSE generations.worker END,
    prompt_tokens = COALESCE(generations.prompt_tokens, EXCLUDED.prompt_tokens)
"""

_FINISHED_GENERATION = """
INSERT INTO generations (request_id, conversation_id, tenant, status, finish_reason,
    prompt_tokens, completion_tokens, ttft_ms, duration_ms, attempt, finished_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
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
    error_code, error_message, finished_at)
VALUES (%s, %s, %s, 'failed', %s, %s, %s, %s)
ON CONFLICT (request_id) DO UPDATE SET
    status = 'failed',
    attempt = GREATEST(generations.attempt, EXCLUDED.attempt),
    error_code = EXCLUDED.error_code,
    error_message = EXCLUDED.error_message,
    finished_at = EXCLUDED.finished_at
"""


def _title(event: PromptSubmitted) -> str | None:
    if event.history_len:
        return None
    first_user = next((m.content for m in event.messages if m.role == "user"), "")
    title = " ".join(storable(first_user).split())
    return title[:TITLE_CHARS] or None


def project(event: Event) -> list[Write]:
    """The writes that make the store reflect ``event``."""
    if isinstance(event, TokenDelta):
        return []  # deltas live in the log; the store keeps whole messages
    at = event.occurred_at
    conv = event.conversation_id
    writes = [
        Write(
            _UPSERT_CONVERSATION,
            (conv, event.tenant, _title(event) if isinstance(event, PromptSubmitted) else None,
             at, at),
        )
    ]
    if isinstance(event, PromptSubmitted):
        for seq in range(event.history_len, len(event.messages)):
            msg = event.messages[seq]
            writes.append(
                Write(_INSERT_MESSAGE,
                      (conv, seq, msg.role, storable(msg.content), event.request_id, at))
            )
        writes.append(
            Write(
                _PROMPT_GENERATION,
                (event.request_id, conv, event.tenant, event.model,
                 Jsonb(event.sampling.model_dump(mode="json")), at),
            )
        )
    elif isinstance(event, GenerationStarted):
        writes.append(
            Write(
                _STARTED_GENERATION,
                (event.request_id, conv, event.tenant, event.attempt, event.worker,
                 event.prompt_tokens),
            )
        )
    elif isinstance(event, GenerationFinished):
        status = "cancelled" if event.finish_reason == "abort" else "finished"
        writes.append(
            Write(
                _INSERT_MESSAGE,
                (conv, event.reply_seq, "assistant", storable(event.text), event.request_id, at),
            )
        )
        writes.append(
            Write(
                _FINISHED_GENERATION,
                (event.request_id, conv, event.tenant, status, event.finish_reason,
                 event.usage.prompt_tokens, event.usage.completion_tokens, event.ttft_ms,
                 event.duration_ms, event.attempt, at),
            )
        )
    elif isinstance(event, GenerationFailed):
        writes.append(
            Write(
                _FAILED_GENERATION,
                (event.request_id, conv, event.tenant, event.attempt, event.code,
                 storable(event.message), at),
            )
        )
    elif isinstance(event, GenerationCancelled):
        pass  # a request to stop; the worker's GenerationFinished(abort) records the outcome
    return writes
