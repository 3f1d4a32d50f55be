"""What a keyring is told and answers with, apart from how it works (``pipeline.keystore``):
its limits, the key it makes for a new conversation, and its error."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pipeline import sealing
from pipeline.kafka.plain import PlainReader
from pipeline.topics import KEYS, PARTITIONED_ALIKE

# The keys a process holds at most (``PIPELINE_KEY_CACHE``), least recently used first out.
KEY_CACHE = 16_384
# A key not found where its reference says, for content written less than the erasure
# window ago, is looked for again for this long before that content reads as erased: the
# answer may have come from a broker that lost its leadership without knowing (a leader
# cut off from its peers answers with the end it had, and new keys are written to its
# successor). Content older than the window may have outlived its key: not found then
# means destroyed.
MISSING_WAIT_S = 120.0
# How long a keyring goes on with the rotations it read before a key not where its
# reference says has it read them again.
ROTATIONS_FRESH_S = 10.0


class KeyringError(sealing.RingUnavailable):
    """The keyring cannot serve: a key wrapped by another key-encryption key, or the
    log not readable in time (``unreachable``: Kafka did not answer)."""


@dataclass(frozen=True)
class NewKey:
    """A data key made for a conversation: its record, to write (and wait for) in
    ``partition`` of ``chat.keys`` before anything is sealed with it; then ``placed``."""

    conversation_id: uuid.UUID
    short_id: str
    aead: AESGCM
    record_key: bytes
    value: bytes
    partition: int


@dataclass(frozen=True)
class KeyringLimits:
    """How long a keyring waits for Kafka (``wait_s``) and for a key not yet where its
    reference says (``missing_wait_s``, see ``MISSING_WAIT_S``); the erasure window;
    the keys it holds at most; whether it keeps the keys a fetch brings besides the one
    asked (``read_ahead``: for a process that reads the log in order, a worker, the
    projector or a replay, those are the next conversations' keys, mostly)."""

    wait_s: float = 15.0
    erasure_window_s: float = 86_400.0
    missing_wait_s: float = MISSING_WAIT_S
    cache: int = KEY_CACHE
    read_ahead: bool = False


def check_layout(bootstrap: str, name: str, keys: int,
                 retrying: Callable[[Callable[[], int]], int], wait_s: float) -> None:
    """``KeyringError`` unless every chat topic made so far has the partition count of
    ``chat.keys``, ``keys`` (``PARTITIONED_ALIKE``): a conversation's records, and its
    keys, are found by one partition number in each. ``retrying(call)`` asks again while
    a leader moves."""
    reader = PlainReader(bootstrap, f"{name}-layout")
    try:
        counts = {topic: retrying(lambda t=topic: len(reader.partitions(t, wait_s)))  # type: ignore[misc]
                  for topic in PARTITIONED_ALIKE if topic != KEYS}
    finally:
        reader.close()
    odd = {topic: n for topic, n in counts.items() if n and n != keys}
    if odd:
        raise KeyringError(
            f"the chat topics must have one partition count, and {KEYS} has {keys} while "
            + ", ".join(f"{t} has {n}" for t, n in odd.items())
            + ": a conversation's partition is its id's hash modulo the count, the same in "
            "each topic. Were partitions added to a topic? See docs/deploying.md, "
            "\"Partitions\".")
