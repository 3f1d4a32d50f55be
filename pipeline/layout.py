"""The chat topics' layout as the broker holds it: a conversation's records, and its
keys, are found by one partition number in each topic of ``PARTITIONED_ALIKE``, so they
must have one partition count, and keep it. Checked by every keyring's start
(``pipeline.keystore``), so by every process.

Their settings are checked too: those that would lose records refuse the start
(``pipeline.topicconfig``).

The count the topics had when the first keyring started is kept in ``chat.rotations``
(key ``layout``, written by that keyring): partitions added later to every topic alike
keep the counts equal, but move conversations away from their records and keys all the
same, and are refused by comparing with it."""

from __future__ import annotations

import json
import logging

from pipeline import topicconfig
from pipeline.kafka import ProduceError, Record
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.keylimits import KeyringError, KeyringLimits
from pipeline.rotations import LAYOUT
from pipeline.topicconfig import Retrying
from pipeline.topics import KEYS, PARTITIONED_ALIKE, ROTATIONS

log = logging.getLogger(__name__)

ADVICE = ("a conversation's partition is its id's hash modulo the count, the same in each "
          "topic. Were partitions added? See docs/deploying.md, \"Partitions\".")


def check_layout(bootstrap: str, name: str, keys: int, recorded: Record | None,
                 retrying: Retrying, limits: KeyringLimits) -> None:
    """``KeyringError`` unless every chat topic made so far has the partition count of
    ``chat.keys``, ``keys`` (``PARTITIONED_ALIKE``), and that is the count ``recorded``
    (the ``layout`` record of ``chat.rotations``), which is written if there is none (yet,
    or since a tombstone); and unless the topics' settings keep their records as the
    process's ``limits`` say (``pipeline.topicconfig``; said, not refused, where they do
    not refuse). ``retrying(call)`` asks again while a leader moves."""
    topicconfig.check(bootstrap, limits.topics, retrying, refuse=limits.refuse_topics)
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
            + ", ".join(f"{t} has {n}" for t, n in odd.items()) + f": {ADVICE}")
    if recorded is None or recorded.value is None:  # none yet, or deleted by an operator
        _record(bootstrap, name, keys)
        return
    made = layout_count(recorded)
    if made is None:
        log.warning("the layout record of %s is unreadable; the chat topics' partition "
                    "count is not checked against it", ROTATIONS)
    elif made != keys:
        raise KeyringError(
            f"the chat topics have {keys} partitions each, but were first used with "
            f"{made} ({ROTATIONS}, key 'layout'): {ADVICE}")


def layout_record(partitions: int) -> tuple[bytes, bytes]:
    return LAYOUT, json.dumps({"v": 1, "partitions": partitions}).encode()


def layout_count(record: Record) -> int | None:
    """The partition count a ``layout`` record holds; None if it holds none."""
    try:
        count = json.loads(record.value or b"")["partitions"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return count if type(count) is int and count > 0 else None


def _record(bootstrap: str, name: str, partitions: int) -> None:
    """Writes the ``layout`` record; a write that fails is said, and left to the next
    process's start (the check it serves is not this one's)."""
    writer = PlainWriter(bootstrap, f"{name}-layout")
    try:
        writer.send(ROTATIONS, *layout_record(partitions))
        failed = writer.flush(10)
    except ProduceError as exc:
        failed = [str(exc)]
    if failed:
        log.warning("could not record the chat topics' partition count (%d) in %s: %s",
                    partitions, ROTATIONS, "; ".join(failed))
    else:
        log.info("recorded the chat topics' partition count (%d) in %s", partitions,
                 ROTATIONS)
