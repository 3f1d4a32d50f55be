"""Versioned SQL migrations, applied in order under an advisory lock.

Two processes migrating at once serialise on the lock; the second sees the work done.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_LOCK_KEY = 0x63686174  # "chat"


class MigrationError(RuntimeError):
    pass


def in_schema(database_url: str, schema: str | None) -> str:
    """``database_url`` with ``schema`` first on the search path."""
    if schema is None:
        return database_url
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema):
        raise ValueError(f"invalid schema name {schema!r}: use lowercase letters, digits, _")
    return make_conninfo(database_url, options=f"-c search_path={schema}")


def migrate(database_url: str, schema: str | None = None) -> list[str]:
    """Apply pending migrations (into ``schema``, created if need be, if given); return the
    versions applied now."""
    applied_now: list[str] = []
    url = in_schema(database_url, schema)  # checks the name before it reaches SQL
    if schema is not None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW server_encoding").fetchone()
        encoding = row[0] if row else None
        if isinstance(encoding, bytes):  # how psycopg reads text from SQL_ASCII
            encoding = encoding.decode("ascii", "replace")
        if encoding != "UTF8":
            # Another encoding (SQL_ASCII: a cluster made without a locale) stores no text
            # the pipeline can read back as text.
            raise MigrationError(f"the database's encoding is {encoding!r}, not UTF8: "
                                 "create it with ENCODING 'UTF8' (initdb --encoding=UTF8)")
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for path in sorted(MIGRATIONS.glob("*.sql")):
                version = path.stem
                if version in done:
                    continue
                with conn.transaction():
                    conn.execute(path.read_text())
                    conn.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
                log.info("applied migration %s", version)
                applied_now.append(version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
    return applied_now
