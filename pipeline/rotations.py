"""KEK rotations (``pipeline keys rotate-kek``), as ``chat.rotations`` records them.

A rotation wraps every live data key anew with the new KEK: it writes each key's record
again under the same record key, so the broker's compaction deletes the record the old
KEK wrapped. A sealed box names its key by the place of its first record, which the
rewritten one no longer has: each rewritten record names that place (``orig``), and the
rotation writes them in the order of those places, each partition's in one span of
offsets (its window). A reader that finds nothing it can open where a box says looks in
the windows of the rotations since (``Keyring``): a binary search by ``orig``, a few
fetches.

``chat.rotations`` is compacted, one record per run of a rotation (key: the new KEK's
fingerprint and when the run began, ``<fingerprint>@<ms>``), written when it starts
(each window open: from the partition's end then) and when it is done (each window's
end). A run's record never replaces another's: a second run to the same KEK (one that
finishes an interrupted run, or one made by mistake after a whole one) keeps the first
run's windows, where the keys it moved are found once compaction has deleted their
first records. Records of stacks before this keyed a rotation by the fingerprint alone,
and are read the same way. A run that was not done, and that no later run replacing the
same KEKs finished (``unfinished``), may have left keys the old KEK alone opens: a
keyring that lacks that KEK refuses to start. Every keyring reads it whole at
start: a rotation or two a year. It holds one more record, the chat topics' partition
count when the first keyring started (key ``layout``, ``pipeline.layout``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.kafka import Record
from pipeline.kafka.lookup import Lookup
from pipeline.kafka.plain import PlainReader
from pipeline.kek import parse_record_key
from pipeline.keylimits import KeyringError
from pipeline.topics import ROTATIONS


@dataclass(frozen=True)
class Rotation:
    to: str  # the new KEK's fingerprint
    replaced: tuple[str, ...]  # the fingerprints of the KEKs it replaced
    # Per partition of chat.keys: where its rewritten records lie, [start, end); end None
    # while the rotation runs.
    windows: dict[int, tuple[int, int | None]]
    done: bool
    at_ms: int

    @property
    def began(self) -> str:
        """When the run began, for a person."""
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at_ms / 1000))

    def record(self) -> tuple[bytes, bytes]:
        return f"{self.to}@{self.at_ms}".encode(), json.dumps({
            "v": 1, "to": self.to, "replaced": list(self.replaced), "done": self.done,
            "at": self.at_ms, "windows": {str(p): list(w) for p, w in self.windows.items()},
        }).encode()

    @staticmethod
    def parse(record: Record) -> Rotation | None:
        if record.value is None:
            return None
        try:
            data = json.loads(record.value)
            windows = {int(p): (int(w[0]), None if w[1] is None else int(w[1]))
                       for p, w in data["windows"].items()}
            return Rotation(str(data["to"]), tuple(str(f) for f in data["replaced"]),
                            windows, bool(data["done"]), int(data["at"]))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError,
                RecursionError):
            return None


def started(to: str, replaced: list[str], ends: dict[int, int]) -> Rotation:
    return Rotation(to, tuple(replaced), {p: (end, None) for p, end in ends.items()}, False,
                    int(time.time() * 1000))


def unfinished(rotations: list[Rotation]) -> list[Rotation]:
    """The runs that were not done and that no later run replacing at least the same
    KEKs finished (to the same KEK, or to another): interrupted, or under way (see the
    module). A later run that finished wrote anew every key those KEKs wrapped."""
    return [r for r in rotations if not r.done and not any(
        later.done and later.at_ms > r.at_ms and set(r.replaced) <= set(later.replaced)
        for later in rotations)]


LAYOUT = b"layout"  # the record key of the chat topics' partition count (pipeline.layout)


def read_rotations(bootstrap: str, name: str, timeout: float = 15.0) -> list[Rotation]:
    """Every rotation, newest first (``chat.rotations`` read whole: a few records)."""
    return rotations_and_layout(bootstrap, name, timeout)[0]


def rotations_and_layout(bootstrap: str, name: str, timeout: float = 15.0
                         ) -> tuple[list[Rotation], Record | None]:
    """Every rotation, newest first, and the newest ``LAYOUT`` record if there is one
    (``chat.rotations`` read whole: a few records)."""
    reader = PlainReader(bootstrap, f"{name}-rotations")
    try:
        partitions = reader.partitions(ROTATIONS, timeout)
        bounds = {p: reader.bounds(ROTATIONS, p, timeout) for p in partitions}
        todo = {p: end for p, (low, end) in bounds.items() if end > low}
        if not todo:
            return [], None
        reader.start({(ROTATIONS, p): bounds[p][0] for p in todo})
        latest: dict[bytes, Record] = {}
        deadline = time.monotonic() + timeout
        while todo:
            for record in reader.read(1000, timeout=0.1):
                latest[record.key or b""] = record
            todo = {p: end for p, end in todo.items()
                    if reader.position(ROTATIONS, p) < end}
            if todo and time.monotonic() > deadline:
                raise TimeoutError(f"{ROTATIONS} not read to its end in {timeout:g} s")
        layout = latest.pop(LAYOUT, None)
        rotations = (Rotation.parse(record) for record in latest.values())
        return sorted((r for r in rotations if r is not None),
                      key=lambda r: r.at_ms, reverse=True), layout
    finally:
        reader.close()


def rotations_at_start(bootstrap: str, name: str, timeout: float,
                       knows: Callable[[str], bool]) -> tuple[list[Rotation], Record | None]:
    """``rotations_and_layout`` for a keyring that starts with the KEKs it ``knows``:
    refused (``KeyringError``) if a rotation not finished replaced a KEK it lacks, since
    the keys that rotation has not written anew open with that KEK alone."""
    rotations, layout = rotations_and_layout(bootstrap, name, timeout)
    for rotation in unfinished(rotations):
        missing = [f for f in rotation.replaced if not knows(f)]
        if missing:
            raise KeyringError(
                f"the KEK rotation to {rotation.to} begun at {rotation.began} has not "
                f"finished, and this process lacks the KEK it replaces ({', '.join(missing)})"
                ": keys it has not written anew open with that KEK alone. Set "
                "PIPELINE_KEK_PREVIOUS to it, and run `pipeline kek rotate` again to finish "
                "the rotation before retiring it")
    return rotations, layout


# A window narrower than this is read through instead of halved (a fetch brings about
# this many key records).
_LINEAR = 64
Read = Callable[[list[tuple[int, int]]], Lookup]


def find_moved(read: Read, partition: int, window: tuple[int, int], orig: int,
               short_id: str) -> Record | None:
    """The record a rotation wrote anew, in ``window`` of ``partition``, for the key whose
    first record was at ``orig`` (None: not there, destroyed since, or never moved). The
    window's moved records are in the order of their ``orig``; other records (keys made
    meanwhile) may lie between them: a binary search, a fetch or so per probe."""
    low, high = window
    while low < high:
        probe = (low + high) // 2 if high - low > _LINEAR else low
        moved = _moved_from(read, partition, probe, high)
        for at, record in moved:
            if at == orig:
                parsed = parse_record_key(record.key)
                return record if parsed is not None and parsed[1] == short_id else None
        if not moved or moved[0][0] > orig:  # it would lie before the probe
            if probe == low:
                return None
            high = probe
        elif moved[-1][0] > orig:  # it would lie among these: it is not there
            return None
        else:
            low = moved[-1][1].position.offset + 1
    return None


def _moved_from(read: Read, partition: int, start: int, high: int
                ) -> list[tuple[int, Record]]:
    """The moved records of the first fetch from ``start`` that holds any (reading on
    past records that are not), each with its ``orig``; none before ``high``: []."""
    at = start
    while at < high:
        batch = sorted((r for r in read([(partition, at)]).nearby
                        if at <= r.position.offset < high),
                       key=lambda r: r.position.offset)
        if not batch:
            return []
        moved = [(o, r) for r in batch if (o := _orig(r)) is not None]
        if moved:
            return moved
        at = batch[-1].position.offset + 1
    return []


def _orig(record: Record) -> int | None:
    if record.value is None or b'"orig"' not in record.value:
        return None
    try:
        orig = json.loads(record.value).get("orig")
    except (ValueError, RecursionError, AttributeError):
        return None
    return orig if isinstance(orig, int) else None
