"""The store against the log: rebuild it with ``pipeline replay`` into a schema of its
own and compare the two, table by table."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import psycopg
from psycopg import sql

from tests.conftest import Stack

TABLES = {
    "conversations": "id",
    "messages": "conversation_id, seq",
    "generations": "request_id",
    "projector_positions": "topic, partition",
}


def snapshot(database_url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(database_url) as conn:
        return {
            table: conn.execute(sql.SQL("SELECT * FROM {}.{} ORDER BY " + order).format(
                sql.Identifier(schema), sql.Identifier(table))).fetchall()
            for table, order in TABLES.items()
        }


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True,
                          text=True, env=stack.env(), timeout=300)


def replay_into_new_schema(stack: Stack, *extra: str) -> str:
    schema = f"replay_{uuid.uuid4().hex[:10]}"
    done = cli(stack, "replay", "--from-beginning", "--schema", schema, *extra)
    assert done.returncode == 0, done.stderr
    assert "events/s" in done.stdout
    return schema


def differences(stack: Stack) -> list[str]:
    """The tables where the live store and a replay of the whole log differ (the
    projector must have caught up first)."""
    schema = replay_into_new_schema(stack)
    live, rebuilt = snapshot(stack.database_url, "public"), snapshot(stack.database_url, schema)
    return [table for table in TABLES if live[table] != rebuilt[table]]
