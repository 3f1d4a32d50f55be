"""The memories, in PostgreSQL with pgvector: a projection of the durable record.

A turn with ``memory`` on is remembered for its tenant's user: its last user message
(the fact the user told), with its embedding. It is recalled once its turn finished
(``GenerationFinished``; a failed or void turn never is). A ``MemoryForgotten`` drops
it and a ``SessionDeleted`` drops its conversation's. Each fact is kept as a row, so the
events may come in any order between topics and more than once: a rebuild from the log
ends the same.

Recall is exact: the nearest of one user's memories by cosine distance, filtered by
tenant and user first (an index on them), so an approximate index's misses never hide a
memory, and nothing outside that tenant's user is ever compared.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from memory.embedder import Vector
from pipeline.pgschema import schema_lock

SCHEMA = """
CREATE EXTENSION IF NOT EXISTS vector;
CREATE TABLE IF NOT EXISTS memories (
    tenant text NOT NULL,
    user_id text NOT NULL,
    id text NOT NULL,
    conversation_id uuid NOT NULL,
    text text NOT NULL,
    model text NOT NULL,
    embedding vector NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, user_id, id)
);
CREATE INDEX IF NOT EXISTS memories_conversation ON memories (conversation_id);
CREATE TABLE IF NOT EXISTS memory_finished (request_id text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS memory_forgotten (
    tenant text NOT NULL, user_id text NOT NULL, id text NOT NULL,
    PRIMARY KEY (tenant, user_id, id));
CREATE TABLE IF NOT EXISTS memory_deleted_conversations (conversation_id uuid PRIMARY KEY);
"""


class PgvectorMissing(RuntimeError):
    pass


def migrate(database_url: str) -> None:
    """Create the tables (and the pgvector extension) if they are not there, under the
    database's lock on schema changes (several services may start at once)."""
    with psycopg.connect(database_url, autocommit=True) as conn, schema_lock(conn):
        try:
            conn.execute(SCHEMA)
        except psycopg.errors.FeatureNotSupported as exc:
            raise PgvectorMissing(
                "PostgreSQL has no pgvector extension: install it on the server (Debian: "
                f"postgresql-NN-pgvector) or point DATABASE_URL at one that has ({exc})"
            ) from exc
        except psycopg.errors.UndefinedFile as exc:
            raise PgvectorMissing(f"PostgreSQL has no pgvector extension ({exc})") from exc


def vector_text(vector: Vector) -> str:
    return "[" + ",".join(f"{x:.7g}" for x in vector) + "]"


@dataclass(frozen=True)
class Memory:
    id: str
    text: str
    conversation_id: uuid.UUID
    created_at: datetime

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "memory", "text": self.text,
                "session_id": str(self.conversation_id),
                "created_at": int(self.created_at.timestamp())}


@dataclass(frozen=True)
class Remembered:
    """A turn to remember (from its prompt)."""

    tenant: str
    user: str
    id: str
    conversation_id: uuid.UUID
    text: str
    at: datetime


Conn = psycopg.AsyncConnection[Any]


async def remember(conn: Conn, items: Sequence[tuple[Remembered, Vector]], model: str) -> int:
    """Store memories unless forgotten or their conversation deleted; how many are new."""
    new = 0
    for item, vector in items:
        cur = await conn.execute(
            "INSERT INTO memories (tenant, user_id, id, conversation_id, text, model, "
            "embedding, created_at) SELECT %s, %s, %s, %s, %s, %s, %s::vector, %s "
            "WHERE NOT EXISTS (SELECT 1 FROM memory_forgotten WHERE tenant = %s AND "
            "id = %s) AND NOT EXISTS (SELECT 1 FROM "
            "memory_deleted_conversations WHERE conversation_id = %s) "
            "ON CONFLICT DO NOTHING",
            (item.tenant, item.user, item.id, item.conversation_id, item.text, model,
             vector_text(vector), item.at, item.tenant, item.id, item.conversation_id))
        new += cur.rowcount
    return new


async def evict(conn: Conn, users: Iterable[tuple[str, str]], keep: int) -> int:
    """Drop each of these users' memories past their ``keep`` newest (by time, then id):
    how many. The set kept depends only on which memories there are, not on the order
    they came in, so a rebuild keeps the same."""
    evicted = 0
    for tenant, user in users:
        cur = await conn.execute(
            "DELETE FROM memories WHERE tenant = %s AND user_id = %s AND id IN (SELECT id "
            "FROM memories WHERE tenant = %s AND user_id = %s "
            "ORDER BY created_at DESC, id DESC OFFSET %s)",
            (tenant, user, tenant, user, keep))
        evicted += cur.rowcount
    return evicted


async def finished(conn: Conn, request_ids: Sequence[str]) -> None:
    if request_ids:
        await conn.cursor().executemany(
            "INSERT INTO memory_finished (request_id) VALUES (%s) ON CONFLICT DO NOTHING",
            [(r,) for r in request_ids])


async def forget(conn: Conn, tenant: str, memory_id: str) -> bool:
    """Forget a memory (a turn's request id, one user's in its tenant): the log's
    ``MemoryForgotten`` names its user by digest only."""
    await conn.execute("INSERT INTO memory_forgotten (tenant, user_id, id) VALUES "
                       "(%s, '', %s) ON CONFLICT DO NOTHING", (tenant, memory_id))
    cur = await conn.execute("DELETE FROM memories WHERE tenant = %s AND id = %s",
                             (tenant, memory_id))
    return cur.rowcount > 0


async def conversation_deleted(conn: Conn, conversation_id: uuid.UUID) -> None:
    await conn.execute("INSERT INTO memory_deleted_conversations (conversation_id) VALUES "
                       "(%s) ON CONFLICT DO NOTHING", (conversation_id,))
    await conn.execute("DELETE FROM memories WHERE conversation_id = %s", (conversation_id,))


_RECALLED = ("FROM memories m JOIN memory_finished f ON f.request_id = m.id "
             "WHERE m.tenant = %s AND m.user_id = %s")


async def nearest(conn: Conn, tenant: str, user: str, vector: Vector, model: str, k: int,
                  exclude: uuid.UUID | None) -> list[Memory]:
    """The user's ``k`` finished memories nearest ``vector`` (by cosine distance), but
    those of conversation ``exclude`` (already in the session's history)."""
    cur = await conn.execute(
        f"SELECT m.id, m.text, m.conversation_id, m.created_at {_RECALLED} AND m.model = %s "
        "AND m.conversation_id IS DISTINCT FROM %s "
        "ORDER BY m.embedding <=> %s::vector, m.id LIMIT %s",
        (tenant, user, model, exclude, vector_text(vector), k))
    return [Memory(*row) for row in await cur.fetchall()]


async def listed(conn: Conn, tenant: str, user: str, limit: int) -> list[Memory]:
    cur = await conn.execute(
        f"SELECT m.id, m.text, m.conversation_id, m.created_at {_RECALLED} "
        "ORDER BY m.created_at DESC, m.id LIMIT %s", (tenant, user, limit))
    return [Memory(*row) for row in await cur.fetchall()]


async def of_user(conn: Conn, tenant: str, user: str, memory_id: str | None
                  ) -> list[Memory]:
    """A user's memories (finished or not), or the one of that id."""
    cur = await conn.execute(
        "SELECT id, text, conversation_id, created_at FROM memories WHERE tenant = %s AND "
        "user_id = %s AND (%s::text IS NULL OR id = %s)", (tenant, user, memory_id,
                                                          memory_id))
    return [Memory(*row) for row in await cur.fetchall()]
