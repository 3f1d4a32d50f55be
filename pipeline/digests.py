"""Keyed digests of what a client sends that the log keeps only to match it again: an
idempotency key, an end user named by a key record. A digest says nothing of its value
to anyone without the key-encryption key (an unkeyed hash of a guessable string, a
user's name, an "alice-tax-secret", is read back by trying guesses), yet every process
that has the KEK computes the same one.

The digest key is derived from the KEK: a KEK rotation (``pipeline keys rotate-kek``)
changes every digest, so an idempotency key used before it and again after it names a
new turn.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence


class Digester:
    """``digest(purpose, tenant, value)``: 32 hex digits, keyed by the KEK; ``every``:
    by the KEK and those a rotation replaces (what records of before it say)."""

    def __init__(self, kek: bytes, previous: Sequence[bytes] = ()) -> None:
        self._keys = [_derived(k) for k in (kek, *previous)]

    def digest(self, purpose: str, tenant: str, value: str) -> str:
        return self.raw(purpose, tenant, value).hex()[:32]

    def every(self, purpose: str, tenant: str, value: str) -> list[str]:
        return [_mac(key, purpose, tenant, value).hex()[:32] for key in self._keys]

    def raw(self, purpose: str, tenant: str, value: str) -> bytes:
        """The digest's 32 bytes (an id derived from it takes what it needs)."""
        return _mac(self._keys[0], purpose, tenant, value)


def _derived(kek: bytes) -> bytes:
    return hmac.new(kek, b"pipeline-digest", hashlib.sha256).digest()


def _mac(key: bytes, purpose: str, tenant: str, value: str) -> bytes:
    message = f"{purpose}\0{tenant}\0{value}".encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).digest()
