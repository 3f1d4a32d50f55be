"""API keys: ``sk-<id>.<secret>``, shown once. Postgres stores the id, the tenant, the
limits, a random salt and ``sha256(salt + secret)``; never the secret.

The secret is 32 random bytes, so a fast salted hash is enough: there is nothing to
guess that a slow hash would protect. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

PREFIX = "sk-"
_ID_BYTES = 6
_SECRET_BYTES = 32
# Compared against when an id is unknown, so an unknown id costs what a wrong secret does.
_DECOY = (b"\0" * 16, hashlib.sha256(b"decoy").digest())


@dataclass(frozen=True)
class Key:
    id: str
    tenant: str
    name: str | None
    rpm: int | None  # requests per minute; None: unlimited
    tpm: int | None  # tokens per minute; None: unlimited
    created_at: datetime
    revoked_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "name": self.name, "rpm": self.rpm,
                "tpm": self.tpm, "created_at": self.created_at.isoformat(),
                "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None}


def _digest(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


def split(presented: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a key as presented, or None if it is not shaped like one."""
    if not presented.startswith(PREFIX) or "." not in presented:
        return None
    key_id, _, secret = presented[len(PREFIX):].partition(".")
    if len(key_id) != 2 * _ID_BYTES or not secret or len(secret) > 100:
        return None
    return key_id, secret


def matches(salt: bytes, stored: bytes, secret: str) -> bool:
    return hmac.compare_digest(_digest(salt, secret), stored)


_COLUMNS = "id, tenant, name, rpm, tpm, created_at, revoked_at"


def create(conn: psycopg.Connection[Any], tenant: str, name: str | None, rpm: int | None,
           tpm: int | None) -> tuple[str, Key]:
    """A new key for ``tenant``: the key itself (to show once) and what is stored."""
    key_id = secrets.token_hex(_ID_BYTES)
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    salt = secrets.token_bytes(16)
    row = conn.execute(
        "INSERT INTO api_keys (id, tenant, name, salt, hash, rpm, tpm)"
        f" VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING {_COLUMNS}",
        (key_id, tenant, name, salt, _digest(salt, secret), rpm, tpm)).fetchone()
    assert row is not None
    return f"{PREFIX}{key_id}.{secret}", Key(*row)


def listed(conn: psycopg.Connection[Any]) -> list[Key]:
    return [Key(*row) for row in conn.execute(
        f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at")]


def revoke(conn: psycopg.Connection[Any], key_id: str) -> bool:
    done = conn.execute("UPDATE api_keys SET revoked_at = now()"
                        " WHERE id = %s AND revoked_at IS NULL", (key_id,))
    return done.rowcount == 1


def decoy() -> tuple[bytes, bytes]:
    return _DECOY


def stop_turns(conn: psycopg.Connection[Any], bootstrap: str, key_id: str) -> int:
    """Cancel the turns of ``key_id`` that have not ended (background ones included), as
    the store knows them: a ``GenerationCancelled`` each, to ``chat.control``, which their
    workers stop them on and their streams end with. The number cancelled."""
    from pipeline.codec import bare, conversation_key
    from pipeline.kafka.plain import PlainWriter
    from pipeline.topics import CONTROL
    from schemas import GenerationCancelled

    rows = conn.execute(
        "SELECT request_id, conversation_id, tenant FROM generations"
        " WHERE charge_key = %s AND status IN ('pending', 'running')", (key_id,)).fetchall()
    if not rows:
        return 0
    writer = PlainWriter(bootstrap, "key-revocation")
    for request_id, conversation_id, tenant in rows:
        event = GenerationCancelled(conversation_id=conversation_id, request_id=request_id,
                                    tenant=tenant, reason="api key revoked")
        writer.send(CONTROL, conversation_key(conversation_id), bare(event))
    failed = writer.flush(30)
    if failed:
        raise RuntimeError(f"cancellations of {len(rows)} turns not all written "
                           f"({failed[0]}); revoke again to retry")
    return len(rows)
