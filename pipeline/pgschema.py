"""Changes of the PostgreSQL schema that services make as they start, one at a time.

Every process that makes tables or a schema if they are missing (the projector's
migrations, the memory service's tables, the schema of an analytics group, a memory
service or a replay) does it under one advisory lock: PostgreSQL's ``CREATE ... IF NOT
EXISTS`` of one object by two sessions at once fails in one of them (measured: 38 of 60
memory services started three at a time).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

_LOCK_KEY = 0x63686174  # "chat"


def check_schema_name(schema: str) -> str:
    """``schema``, if it is a name the services use as is in SQL (else ValueError)."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
        raise ValueError(f"invalid schema name {schema!r}: use lowercase letters, digits, _")
    return schema


@contextlib.contextmanager
def schema_lock(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Hold the database's lock on schema changes (see the module) for the block."""
    conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
    try:
        yield
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))


def create_schema(database_url: str, schema: str) -> None:
    """Create ``schema`` unless it exists (under ``schema_lock``)."""
    name = sql.Identifier(check_schema_name(schema))
    with psycopg.connect(database_url, autocommit=True) as conn, schema_lock(conn):
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name))
