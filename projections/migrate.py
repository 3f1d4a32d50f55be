"""Versioned SQL migrations, applied in order under an advisory lock.

Two processes migrating at once serialise on the lock; the second sees the work done.
It is the lock of every change of the schema that a service makes as it starts
(``pipeline.pgschema``).
Each migration applied is recorded with the SHA-256 of its text: a database migrated from
a different text of a migration (one edited after it was applied) is refused, naming it,
since its schema is not the one this code expects. A migration recorded before digests
were gets the digest of the text found now.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from pipeline.pgschema import check_schema_name, create_schema, schema_lock

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class MigrationError(RuntimeError):
    pass


def in_schema(database_url: str, schema: str | None) -> str:
    """``database_url`` with ``schema`` first on the search path."""
    if schema is None:
        return database_url
    return make_conninfo(database_url, options=f"-c search_path={check_schema_name(schema)}")


def migrate(database_url: str, schema: str | None = None) -> list[str]:
    """Apply pending migrations (into ``schema``, created if need be, if given); return the
    versions applied now."""
    applied_now: list[str] = []
    url = in_schema(database_url, schema)  # checks the name before it reaches SQL
    if schema is not None:
        create_schema(database_url, schema)
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
        with schema_lock(conn):
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            conn.execute("ALTER TABLE schema_migrations ADD COLUMN IF NOT EXISTS digest text")
            done: dict[str, str | None] = dict(
                conn.execute("SELECT version, digest FROM schema_migrations").fetchall())
            for path in sorted(MIGRATIONS.glob("*.sql")):
                version, text = path.stem, path.read_text()
                digest = hashlib.sha256(text.encode()).hexdigest()
                if version in done:
                    recorded = done[version]
                    if recorded is None:  # recorded before digests were
                        conn.execute("UPDATE schema_migrations SET digest = %s"
                                     " WHERE version = %s", (digest, version))
                    elif recorded != digest:
                        raise MigrationError(
                            f"migration {version} was applied to this database from another "
                            f"text than {path.name} holds now (SHA-256 {recorded[:12]}, "
                            f"not {digest[:12]}): its schema is not the one this code "
                            "expects. Run the code that migrated it, or bring the schema to "
                            "this text by hand and record it in schema_migrations.digest")
                    continue
                with conn.transaction():
                    conn.execute(text)
                    conn.execute("INSERT INTO schema_migrations (version, digest)"
                                 " VALUES (%s, %s)", (version, digest))
                log.info("applied migration %s", version)
                applied_now.append(version)
    return applied_now
