"""``pipeline kek rotate``: wrap every live data key anew with the current key-encryption
key, while the service runs (``docs/erasure.md``, "Rotating the KEK").

Before it: every process runs with ``PIPELINE_KEK`` the new KEK and
``PIPELINE_KEK_PREVIOUS`` the old one (a rolling restart): new keys are wrapped with the
new KEK, and keys of either are read. Then the command, with the same settings:

1. records the rotation in ``chat.rotations``: where each ``chat.keys`` partition ends
   now, where its window begins (``pipeline.rotations``);
2. reads each partition to that end and writes each live key a previous KEK wrapped
   anew, under the same record key (so compaction deletes the old record), naming the
   offset of its first record, in the order of those offsets;
3. reads ``chat.erasures`` to its end and writes again the tombstone of each key it
   wrote anew whose conversation was erased meanwhile: a tombstone written between its
   read and its write would otherwise have been undone;
4. records where each window ends.

After it: the broker's compaction deletes the old records within the erasure window;
then ``PIPELINE_KEK_PREVIOUS`` can go (a second rolling restart), and the old KEK with it.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from dataclasses import replace

from tqdm import tqdm

from pipeline.kafka import iter_spans
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.kek import Kek, fingerprint, key_info, load_kek, load_previous_keks
from pipeline.keystore import Keyring, open_keyring
from pipeline.rotations import Rotation, read_rotations, started, unfinished
from pipeline.settings import CommonSettings
from pipeline.topics import ERASURES, KEYS, ROTATIONS

# Data keys by conversation: its tenant, and the keys' short ids.
Keys = dict[uuid.UUID, tuple[str, list[str]]]


class RotationError(Exception):
    """The rotation cannot be made (said in one line)."""


def rotate_command(common: CommonSettings, args: argparse.Namespace) -> int:
    current, previous = load_kek(common), load_previous_keks(common)
    if not previous:
        print("pipeline kek rotate: PIPELINE_KEK_PREVIOUS names no key-encryption key to "
              "replace (set PIPELINE_KEK to the new KEK and PIPELINE_KEK_PREVIOUS to the "
              "old one, in every process first)", file=sys.stderr)
        return 2
    kek = Kek(current, previous)
    replaced = [fingerprint(k) for k in previous]
    writer = PlainWriter(common.kafka_bootstrap, "kek-rotate", compression=common.compression)
    reader = PlainReader(common.kafka_bootstrap, "kek-rotate")
    try:
        partitions = reader.partitions(KEYS)
        ends = {p: reader.end(KEYS, p) for p in partitions}
        starts = {p: reader.bounds(KEYS, p)[0] for p in partitions}
    finally:
        reader.close()
    for earlier in unfinished(read_rotations(common.kafka_bootstrap, "kek-rotate")):
        if earlier.to == kek.fingerprint:
            print(f"finishing the rotation to {earlier.to} begun at {earlier.began}, "
                  "which did not finish: the keys it wrote anew stay where it put them",
                  flush=True)
    rotation = started(kek.fingerprint, replaced, ends)
    _write(writer, ROTATIONS, *rotation.record())
    total = sum(ends[p] - starts[p] for p in partitions)
    bar = tqdm(total=total, unit="rec", desc=f"rotating to {kek.fingerprint}")
    rewrapped = retombstoned = 0
    windows: dict[int, tuple[int, int | None]] = {}
    with open_keyring(common, "kek-rotate") as keyring:
        for p in partitions:  # each partition's window: its keys in the order they came
            moved, live = _rewrap(common, kek, replaced, keyring, writer, p, starts[p],
                                  ends[p], bar)
            rewrapped += sum(len(ids) for _, ids in moved.values())
            retombstoned += _undo_undone(keyring, writer, live, p)
            end = _end(common, p)
            windows[p] = (ends[p], end)
    bar.close()
    _write(writer, ROTATIONS, *replace(rotation, windows=windows, done=True).record())
    print(f"wrapped {rewrapped} data key(s) anew with KEK {kek.fingerprint}"
          + (f"; {retombstoned} erased meanwhile destroyed again" if retombstoned else "")
          + f". Compaction deletes the old records within "
          f"{common.erasure_window_ms / 3_600_000:g} h; then PIPELINE_KEK_PREVIOUS can go.")
    return 0


def _rewrap(common: CommonSettings, kek: Kek, replaced: list[str], keyring: Keyring,
            writer: PlainWriter, partition: int, start: int, end: int,
            bar: tqdm) -> tuple[Keys, Keys]:
    """Write anew, in offset order, each live key of the partition (up to ``end``) that a
    replaced KEK wrapped: what was written, and every live key (by conversation: its
    tenant, short ids)."""
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    for record in iter_spans(common.kafka_bootstrap, KEYS, {partition: (start, end)}):
        latest[record.key or b""] = (record.position.offset, record.value)
        bar.update(1)
    moved: Keys = {}
    live: Keys = {}
    for key, (offset, value) in sorted(latest.items(), key=lambda kv: kv[1][0]):
        if value is None:
            continue  # destroyed
        try:
            info = key_info(key, value)
        except ValueError:
            continue  # not a key's record
        live.setdefault(info.conversation_id, (info.tenant, []))[1].append(info.short_id)
        if info.kek not in replaced or keyring.revoked(info.conversation_id):
            continue
        writer.send(KEYS, key, kek.rewrap(key, value, offset), partition)
        moved.setdefault(info.conversation_id, (info.tenant, []))[1].append(info.short_id)
        if len(moved) % 1000 == 0:
            writer.poll()
    failed = writer.flush(120)
    if failed:
        raise RotationError(f"keys written anew were not acknowledged: {failed[0]}")
    return moved, live


def _undo_undone(keyring: Keyring, writer: PlainWriter, live: Keys, partition: int) -> int:
    """Destroy again the live keys of conversations erased: a key this run wrote anew
    after its erasure's tombstone, and one an earlier run cut short left so (its erasure
    written again with the tombstones: ``pipeline.erasures``)."""
    if not keyring.catch_up():
        raise RotationError(f"could not read {ERASURES} to its end: the keys written anew "
                            "are not known to be of live conversations; run it again")
    erased = [(c, tenant, ids) for c, (tenant, ids) in live.items() if keyring.revoked(c)]
    for conversation, tenant, short_ids in erased:
        writer.send(ERASURES, *keyring.erasure(conversation, tenant))
        for short_id in short_ids:
            writer.send(KEYS, f"{conversation}/{short_id}".encode(), None, partition)
    failed = writer.flush(60)
    if failed:
        raise RotationError(f"tombstones not acknowledged: {failed[0]}")
    return sum(len(ids) for _, _, ids in erased)


def _end(common: CommonSettings, partition: int) -> int:
    reader = PlainReader(common.kafka_bootstrap, "kek-rotate")
    try:
        return reader.end(KEYS, partition)
    finally:
        reader.close()


def _write(writer: PlainWriter, topic: str, key: bytes, value: bytes) -> None:
    writer.send(topic, key, value)
    failed = writer.flush(30)
    if failed:
        raise RotationError(f"{topic} did not take the record: {failed[0]}")


__all__ = ["Rotation", "RotationError", "rotate_command"]
