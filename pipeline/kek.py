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
import threading
import time
import uuid
from collections.abc import Sequence
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
    return _kek_of(text, source)


def load_previous_keks(common: CommonSettings) -> list[bytes]:
    """The KEKs a rotation replaces (``PIPELINE_KEK_PREVIOUS``, comma-separated)."""
    if common.kek_previous is None:
        return []
    return [_kek_of(text.strip(), "PIPELINE_KEK_PREVIOUS")
            for text in common.kek_previous.get_secret_value().split(",") if text.strip()]


def _kek_of(text: str, source: str) -> bytes:
    try:
        kek = base64.b64decode(text, validate=True)
    except ValueError:
        kek = b""
    if len(kek) != 32:
        raise KekError(f"{source} is not a key-encryption key: base64 of 32 bytes "
                       "(`head -c 32 /dev/urandom | base64` makes one)")
    return kek


def _make_kek_file(path: Path) -> None:
    """Made whole under another name, then linked into place: a process of the stack
    starting meanwhile reads the whole key or makes its own attempt, never a file begun
    (four starting at once read an empty one in 87 rounds of 200 before)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    made = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(base64.b64encode(AESGCM.generate_key(bit_length=256)).decode() + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(made, path)
    except FileExistsError:  # another process of the stack made it first
        return
    finally:
        made.unlink(missing_ok=True)
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
        references named their place), or for a place no topic has (a partition or an
        offset past Kafka's 32 and 64 bits: a hostile box's, which the Kafka client
        would refuse with an error of its own)."""
        parts = text.split(".")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            return None
        partition, offset = int(parts[1]), int(parts[2])
        if partition >= 2**31 or offset >= 2**63:
            return None
        return KeyRef(parts[0], partition, offset)


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
    user_digest: str | None  # its end user's digest (None: none, or a record of before)
    at_ms: int
    placed: bool  # written with its place named (references), or before
    # A key wrapped anew by a rotation: the offset of its first record (None: this is it).
    orig: int | None = None
    kek: str | None = None  # the fingerprint of the KEK that wrapped it


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
        tenant, user = data["tenant"], data.get("user_digest")
        at = int(data.get("at", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a data key's record: {exc!r}") from None
    if not isinstance(tenant, str) or not (user is None or isinstance(user, str)):
        raise ValueError("not a data key's record: tenant and user are text")
    orig = data.get("orig")
    if orig is not None and (not isinstance(orig, int) or orig < 0):
        raise ValueError("not a data key's record: orig is an offset")
    kek = data.get("kek")
    return KeyInfo(parsed[0], parsed[1], tenant, user, at, data.get("v") == RECORD_V, orig,
                   kek if isinstance(kek, str) else None)


class Kek:
    """Wraps data keys into their records with the current KEK, and unwraps them with
    the KEK each names: the current one, or one it replaced (during a rotation)."""

    def __init__(self, kek: bytes, previous: Sequence[bytes] = ()) -> None:
        self._aead = AESGCM(kek)
        self.fingerprint = fingerprint(kek)
        self._by_fingerprint = {fingerprint(k): AESGCM(k) for k in previous}
        self._by_fingerprint[self.fingerprint] = self._aead

    def knows(self, kek_fingerprint: str) -> bool:
        return kek_fingerprint in self._by_fingerprint

    def wrap(self, conversation_id: uuid.UUID, short_id: str, secret: bytes, tenant: str,
             user_digest: str | None, *, at: int | None = None,
             orig: int | None = None) -> bytes:
        """The record of a data key: its end user named by digest only
        (``pipeline.digests``: a key record outlives the conversation's deletion until
        compaction). ``orig``: a key wrapped anew by a rotation names the offset its
        first record had, which the boxes that name it say."""
        nonce = os.urandom(sealing.NONCE_BYTES)
        wrapped = self._aead.encrypt(nonce, secret, record_key(conversation_id, short_id))
        record = {
            "v": RECORD_V, "conversation_id": str(conversation_id), "key_id": short_id,
            "tenant": tenant, "user_digest": user_digest, "kek": self.fingerprint,
            "wrapped": base64.b64encode(nonce + wrapped).decode(),
            "at": int(time.time() * 1000) if at is None else at}
        if orig is not None:
            record["orig"] = orig
        return json.dumps(record).encode()

    def rewrap(self, key: bytes | None, value: bytes, offset: int) -> bytes:
        """A key's record wrapped anew with the current KEK (by a rotation), naming the
        offset of its first record (``offset`` if this is it)."""
        data = json.loads(value)
        secret = self._secret(key, data)
        parsed = parse_record_key(key)
        assert parsed is not None  # _secret checked it
        return self.wrap(parsed[0], parsed[1], secret, data["tenant"],
                         data.get("user_digest"), at=int(data.get("at", 0)),
                         orig=int(data.get("orig", offset)))

    def unwrap(self, key: bytes | None, value: bytes, key_id: str) -> sealing.DataKey:
        """The data key in a record, named ``key_id`` (``KekError`` if a KEK this process
        does not have wrapped it; ``ValueError`` if the record is not a data key, or was
        tampered with)."""
        parsed = parse_record_key(key)
        if parsed is None:
            raise ValueError(f"keyed {key!r}: not a data key's record")
        try:
            data = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not a data key's record: {exc!r}") from None
        return sealing.DataKey(key_id, parsed[0], AESGCM(self._secret(key, data)))

    def _secret(self, key: bytes | None, data: object) -> bytes:
        parsed = parse_record_key(key)
        if parsed is None:
            raise ValueError(f"keyed {key!r}: not a data key's record")
        conversation, short_id = parsed
        try:
            assert isinstance(data, dict)
            kek = data["kek"]
            raw = base64.b64decode(data["wrapped"])
        except (AssertionError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a data key's record: {exc!r}") from None
        aead = self._by_fingerprint.get(kek) if isinstance(kek, str) else None
        if aead is None:
            raise KekError(f"key {short_id} of conversation {conversation} is wrapped by "
                           f"key-encryption key {kek}, and this process has "
                           f"{self.fingerprint}: give every process the same PIPELINE_KEK "
                           "(and, during a rotation, the one it replaces as "
                           "PIPELINE_KEK_PREVIOUS)")
        try:
            return aead.decrypt(raw[:sealing.NONCE_BYTES], raw[sealing.NONCE_BYTES:],
                                record_key(conversation, short_id))
        except (InvalidTag, ValueError) as exc:
            raise ValueError(f"key {short_id} does not unwrap: {exc!r}") from None
