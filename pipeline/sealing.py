"""Content sealed with its conversation's data key, so that destroying the key erases the
content from every copy of the log (crypto-shredding; ``docs/erasure.md``).

Each conversation has data keys of its own (AES-256-GCM), kept in ``chat.keys`` wrapped
by the key-encryption key (``pipeline.keystore``). What a conversation's events say
(messages, replies, titles, the live stream's text) is sealed with one of them: the
record keeps a box, ``key id`` and ``nonce || ciphertext``, where the text was. Ids,
counts, times and codes stay in the clear: the log stays readable for routing,
ordering, analytics and audit of who did what, and a conversation whose key is gone
keeps them.

This module is the cipher; it does no I/O. A ``Cipher`` holds the keyrings a reader or
writer seals and opens with, and is given to the codec explicitly
(``pipeline.codec.Codec``): a codec whose cipher holds a keyring reads and writes
sealed content, and one whose cipher holds none (``CLEAR``) writes content in the clear
and reads sealed content as erased.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import itertools
import os
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

T = TypeVar("T")

NONCE_BYTES = 12
# The box's first byte, after decryption: how the payload is packed.
_RAW, _DEFLATED = b"\x00", b"\x01"
# Payloads at least this long, and no longer than the second, are deflated before
# sealing: ciphertext does not compress, so the compression Kafka's batches would have
# given the text is given here instead. Past a MiB, deflating costs a writer's event
# loop tenths of a second per record (0.4 s for 9 MiB), for records the log would
# mostly refuse anyway.
DEFLATE_FROM = 256
DEFLATE_UP_TO = 2**20
# The most a box opens to: a record is at most PIPELINE_MAX_RECORD_BYTES, but deflated
# content could open to far more (a box a hostile producer made); past this it is
# refused as unreadable, and its record dead-lettered.
MAX_OPENED = 64 * 2**20
# What a writer puts as the key id of content it dropped because its conversation's
# keys were destroyed while it ran: such a box holds nothing.
ERASED = "erased"


class _Nonces:
    """GCM nonces, never twice under one key: 8 random bytes drawn per process (again
    in a forked child, and every 2**32 nonces), then a 4-byte counter. Two processes
    sealing with the same key draw the same 8 bytes with odds of about n**2 / 2**65
    over n processes; one ``os.urandom`` call per nonce cost a third of a seal."""

    def __init__(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        # One object, swapped whole: a thread holds a prefix and its own counter.
        self._state = (os.urandom(8), itertools.count(1))

    def __call__(self) -> bytes:
        prefix, counter = self._state
        n = next(counter)  # one call in C: no two threads get the same number
        if n >= 2**32:
            self._redraw()
            return self()
        return prefix + n.to_bytes(4, "big")


_nonce = _Nonces()
os.register_at_fork(after_in_child=_nonce._redraw)


@dataclass(frozen=True, slots=True)
class DataKey:
    key_id: str
    conversation_id: uuid.UUID
    aead: AESGCM


class RingUnavailable(RuntimeError):
    """A keyring that cannot answer: ``unreachable`` if its key topic could not be read
    (Kafka away: worth asking again), else for good (``pipeline.keystore``)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class KeyNotHeld(Exception):
    """A key no keyring of the cipher holds yet, nor knows to be gone, asked for on a
    thread that runs an event loop. Looking for it reads the key topic, which may take
    as long as Kafka does to answer, and would stall every task of the loop meanwhile:
    the caller looks for it on another thread (``pipeline.codec.Codec.decode_async``)."""

    def __init__(self, key_id: str, written_at: float | None = None) -> None:
        super().__init__(f"data key {key_id} not held yet")
        self.key_id = key_id
        self.written_at = written_at


class Ring(Protocol):
    def for_writing(self, conversation_id: uuid.UUID) -> DataKey | Literal["erased"] | None:
        """The key this ring holds to seal the conversation's content with; ``"erased"``
        if its keys were destroyed; None if it holds none (the writer names its key:
        ``pipeline.codec.Codec.encode``)."""

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> DataKey | None:
        """The key of that id, or None if it is gone (destroyed, or never existed). A key
        neither held nor known to be gone is looked for (a read of the key topic) if
        ``wait``; else ``KeyNotHeld``. ``written_at``: when the content it sealed was
        written (seconds since the epoch), which says how long to look."""

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        """Whether the conversation's keys were destroyed (a set look-up: never waits)."""


# The keys a coroutine looked up on another thread after ``KeyNotHeld`` (None: gone), for
# the decode it then runs again: that decode uses them whatever the keyrings' bounded
# caches let go meanwhile (other look-ups, keys read ahead), so it cannot miss again
# (``pipeline.codec``).
LOOKED_UP: ContextVar[dict[str, DataKey | None] | None] = ContextVar("looked_up",
                                                                     default=None)


class Cipher:
    """The keyrings one reader or writer seals and opens content with, asked in the
    order given. A process reading several clusters (an auditor, the tests) holds a ring
    for each; a cipher with none seals nothing and opens nothing."""

    __slots__ = ("rings",)

    def __init__(self, *rings: Ring) -> None:
        self.rings = rings

    def __bool__(self) -> bool:
        return bool(self.rings)

    def __repr__(self) -> str:
        return f"Cipher({len(self.rings)} rings)"

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        """Whether a ring knows the conversation's keys destroyed."""
        for ring in self.rings:  # a loop, not any(): asked per turn per live record
            if ring.revoked(conversation_id):
                return True
        return False

    def writing_key(self, conversation_id: uuid.UUID) -> DataKey | Literal["erased"] | None:
        for ring in self.rings:
            found = ring.for_writing(conversation_id)
            if found is not None:
                return found
        return None

    def reading_key(self, key_id: str, written_at: float | None = None) -> DataKey | None:
        """The key of that id, or None if it is gone (``written_at``: when the content
        it sealed was written). Never waits on a thread that runs an event loop:
        ``KeyNotHeld`` there if no ring holds it or knows it gone yet."""
        if key_id == ERASED:
            return None
        looked_up = LOOKED_UP.get()
        if looked_up is not None and key_id in looked_up:
            return looked_up[key_id]
        # The ring that holds the key answers before any other looks for it.
        unknown = False
        for ring in self.rings:
            try:
                found = ring.for_reading(key_id, False, written_at)
            except KeyNotHeld:
                unknown = True
                continue
            if found is not None:
                return found
        if not unknown:
            return None
        if _on_a_loop():
            raise KeyNotHeld(key_id, written_at)
        if len(self.rings) > 1:
            # Each ring would look for a recent key it does not hold for minutes (see
            # ``pipeline.keystore``) though the key is another cluster's: a reader of
            # several clusters takes a key not found as gone at once.
            written_at = None
        for ring in self.rings:
            found = ring.for_reading(key_id, True, written_at)
            if found is not None:
                return found
        return None


# Seals nothing, opens nothing: content written in the clear, sealed content read as
# erased.
CLEAR = Cipher()


# Key look-ups that wait on Kafka run on threads of their own: however many wait (Kafka
# away), they take none of the threads the rest of the process shares (API keys'
# hashing, refreshes); the keyring makes one look-up at a time anyway.
_LOOKUPS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="key-look-up")


async def looked_up(call: Callable[..., T], *args: object) -> T:
    """``call(*args)``, a key look-up that may wait on Kafka, on the look-ups' threads;
    one whose caller stopped waiting before it began is never made."""
    return await asyncio.get_running_loop().run_in_executor(
        _LOOKUPS, functools.partial(call, *args))


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def seal(key: DataKey, payload: bytes) -> str:
    """``payload`` sealed with ``key``, as base64 text (bound to its key id)."""
    packed = _RAW + payload
    if DEFLATE_FROM <= len(payload) <= DEFLATE_UP_TO:
        deflated = zlib.compress(payload, 1)
        if len(deflated) < len(payload):
            packed = _DEFLATED + deflated
    nonce = _nonce()
    sealed = key.aead.encrypt(nonce, packed, key.key_id.encode())
    return binascii.b2a_base64(nonce + sealed, newline=False).decode("ascii")


class Unreadable(ValueError):
    """A box that does not open with the key it names: corrupted, or not sealed with it."""


def unseal(key: DataKey, box: str) -> bytes:
    try:
        raw = base64.b64decode(box)
        packed = key.aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], key.key_id.encode())
    except (ValueError, InvalidTag) as exc:
        raise Unreadable(f"a box of key {key.key_id} does not open") from exc
    if packed[:1] != _DEFLATED:
        return packed[1:]
    inflater = zlib.decompressobj()
    try:
        opened = inflater.decompress(packed[1:], MAX_OPENED)
    except zlib.error as exc:
        raise Unreadable(f"a box of key {key.key_id} does not inflate: {exc}") from None
    if inflater.unconsumed_tail:
        raise Unreadable(f"a box of key {key.key_id} opens to more than {MAX_OPENED:,} "
                         "bytes")
    return opened


def new_data_key(conversation_id: uuid.UUID) -> tuple[DataKey, bytes]:
    """A fresh key for the conversation, and its 32 secret bytes (to wrap and keep)."""
    secret = AESGCM.generate_key(bit_length=256)
    return DataKey(os.urandom(8).hex(), conversation_id, AESGCM(secret)), secret
