"""The chat topics' layout as the broker holds it: a conversation's records, and its
keys, are found by one partition number in each topic of ``PARTITIONED_ALIKE``, so they
must have one partition count. Checked by every keyring's start (``pipeline.keystore``),
so by every process."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.kafka.plain import PlainReader
from pipeline.keylimits import KeyringError
from pipeline.topics import KEYS, PARTITIONED_ALIKE


def check_layout(bootstrap: str, name: str, keys: int,
                 retrying: Callable[[Callable[[], int]], int]) -> None:
    """``KeyringError`` unless every chat topic made so far has the partition count of
    ``chat.keys``, ``keys`` (``PARTITIONED_ALIKE``): a conversation's records, and its
    keys, are found by one partition number in each. ``retrying(call)`` asks again while
    a leader moves."""
    reader = PlainReader(bootstrap, f"{name}-layout")
    try:
        counts = {topic: retrying(lambda t=topic: len(reader.partitions(t)))  # type: ignore[misc]
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
