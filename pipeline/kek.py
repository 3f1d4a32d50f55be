"""The key-encryption key (KEK), and a data key's record in ``chat.keys``: how a key is
wrapped into its record and unwrapped from it, and the reference a sealed box names it by.

A record of ``chat.keys`` is one data key: key ``<conversation>/<short id>``, value the
key wrapped (AES-256-GCM) by the KEK, bound to its conversation and short id, with the
conversation's tenant and the user its first turn named. It lies in its conversation's
partition. A box names its key by reference: ``<short id>.<partition>.<offset>``, where
the record lies, so any reader finds it with one fetch (``pipeline.keystore``). Keys
written before references named their place are named by their short id alone.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pipeline import sealing
from pipeline.settings import CommonSettings

log = logging.getLogger(__name__)
# A key record's version: 2 names its place (references), 1 did not.
RECORD_V = 2


class KekError(ValueError):
    """No usable key-encryption key, or a record wrapped by another one."""


def load_kek(common: CommonSettings) -> bytes:
    """The key-encryption key: ``PIPELINE_KEK``, else the file ``PIPELINE_KEK_FILE``
    (``<state dir>/kek``), made there with a new key if it does not exist."""
    if common.kek is not None:
        text = common.kek.get_secret_value()
        source = "PIPELINE_KEK"
    else:
        path = common.kek_file or common.state_dir / "kek"
        if not path.exists():
            _make_kek_file(path)
        text = path.read_text().strip()
        source = str(path)
    try:
        kek = base64.b64decode(text, validate=True)
    except ValueError:
        kek = b""
    if len(kek) != 32:
        raise KekError(f"{source} is not a key-encryption key: base64 of 32 bytes "
                       "(`head -c 32 /dev/urandom | base64` makes one)")
    return kek


def _make_kek_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process of the stack made it first
        return
    with os.fdopen(fd, "w") as out:
        out.write(base64.b64encode(AESGCM.generate_key(bit_length=256)).decode() + "\n")
    log.warning("made a key-encryption key at %s: every process of this stack must have "
                "it; set PIPELINE_KEK (from your secret store) in production", path)


def fingerprint(kek: bytes) -> str:
    return hashlib.sha256(b"pipeline-kek" + kek).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class KeyRef:
    """Where a data key's record lies."""

    short_id: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.short_id}.{self.partition}.{self.offset}"

    @staticmethod
    def parse(text: str) -> KeyRef | None:
        """The reference a box names; None for a short id alone (a key written before
        references named their place)."""
        parts = text.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            return None
        return KeyRef(parts[0], int(parts[1]), int(parts[2]))


def record_key(conversation_id: uuid.UUID, short_id: str) -> bytes:
    return f"{conversation_id}/{short_id}".encode()


def parse_record_key(key: bytes | None) -> tuple[uuid.UUID, str] | None:
    """The conversation and short id a record of ``chat.keys`` is keyed by (None: not a
    data key's record)."""
    try:
        conversation, short_id = (key or b"").decode().split("/", 1)
        return uuid.UUID(conversation), short_id
    except ValueError:
        return None


@dataclass(frozen=True)
class KeyInfo:
    """What a key record says in the clear: for the store's index of keys."""

    conversation_id: uuid.UUID
    short_id: str
    tenant: str
    user: str | None
    at_ms: int
    placed: bool  # written with its place named (references), or before


def key_info(key: bytes | None, value: bytes) -> KeyInfo:
    """The clear part of a key record (``ValueError`` if it is not one)."""
    parsed = parse_record_key(key)
    if parsed is None:
        raise ValueError(f"keyed {key!r}: not a data key's record")
    try:
        data = json.loads(value)
    except RecursionError:  # nested past what a parser takes: not a key's
        raise ValueError("not a data key's record: nested too deep") from None
    if not isinstance(data, dict):
        raise ValueError("not a data key's record")
    try:
        tenant, user = data["tenant"], data.get("user")
        at = int(data.get("at", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a data key's record: {exc!r}") from None
    if not isinstance(tenant, str) or not (user is None or isinstance(user, str)):
        raise ValueError("not a data key's record: tenant and user are text")
    return KeyInfo(parsed[0], parsed[1], tenant, user, at, data.get("v") == RECORD_V)


class Kek:
    """Wraps data keys into their records, and unwraps them."""

    def __init__(self, kek: bytes) -> None:
        self._aead = AESGCM(kek)
        self.fingerprint = fingerprint(kek)

    def wrap(self, conversation_id: uuid.UUID, short_id: str, secret: bytes, tenant: str,
             user: str | None) -> bytes:
        nonce = os.urandom(sealing.NONCE_BYTES)
        wrapped = self._aead.encrypt(nonce, secret, record_key(conversation_id, short_id))
        return json.dumps({
            "v": RECORD_V, "conversation_id": str(conversation_id), "key_id": short_id,
            "tenant": tenant, "user": user, "kek": self.fingerprint,
            "wrapped": base64.b64encode(nonce + wrapped).decode(),
            "at": int(time.time() * 1000)}).encode()

    def unwrap(self, key: bytes | None, value: bytes, key_id: str) -> sealing.DataKey:
        """The data key in a record, named ``key_id`` (``KekError`` if another KEK wrapped
        it; ``ValueError`` if the record is not a data key, or was tampered with)."""
        parsed = parse_record_key(key)
        if parsed is None:
            raise ValueError(f"keyed {key!r}: not a data key's record")
        conversation, short_id = parsed
        try:
            data = json.loads(value)
            kek = data["kek"]
            raw = base64.b64decode(data["wrapped"])
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"not a data key's record: {exc!r}") from None
        if kek != self.fingerprint:
            raise KekError(f"key {short_id} of conversation {conversation} is wrapped by "
                           f"key-encryption key {kek}, and this process has "
                           f"{self.fingerprint}: give every process the same PIPELINE_KEK")
        try:
            secret = self._aead.decrypt(raw[:sealing.NONCE_BYTES], raw[sealing.NONCE_BYTES:],
                                        record_key(conversation, short_id))
        except (InvalidTag, ValueError) as exc:
            raise ValueError(f"key {short_id} does not unwrap: {exc!r}") from None
        return sealing.DataKey(key_id, conversation, AESGCM(secret))
