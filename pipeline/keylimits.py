"""What a keyring is told and answers with, apart from how it works (``pipeline.keystore``):
its limits, the key it makes for a new conversation, and its error."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pipeline import sealing
from pipeline.topics import TopicPolicy

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
    projector or a replay, those are the next conversations' keys, mostly); what the
    topics must keep for this process (``topics``: ``pipeline.topicconfig``), and
    whether topics that would lose records refuse its start (``refuse_topics``: not for
    a process that only reads, an audit or a replay, which such a cluster needs most)."""

    wait_s: float = 15.0
    missing_wait_s: float = MISSING_WAIT_S
    cache: int = KEY_CACHE
    read_ahead: bool = False
    topics: TopicPolicy = field(default_factory=TopicPolicy)
    refuse_topics: bool = True

    @property
    def erasure_window_s(self) -> float:
        return self.topics.erasure_window_ms / 1000

