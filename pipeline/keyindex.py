"""Where the data keys written before key references named their place lie: a sealed
box of then names its key by short id alone. The index is made by reading ``chat.keys``
once, the first time such a key is asked for (``Keyring``); content of today never
needs it."""

from __future__ import annotations

import logging
import time

from pipeline.kafka import iter_spans
from pipeline.kafka.lookup import PositionReader
from pipeline.kek import parse_record_key
from pipeline.topics import KEYS

log = logging.getLogger(__name__)


def legacy_index(bootstrap: str, reader: PositionReader, wait_s: float
                 ) -> dict[str, tuple[int, int]]:
    """Each such key's short id -> its partition and offset in ``chat.keys``."""
    spans = {p: (0, reader.bounds(p, wait_s)[1]) for p in reader.partitions(wait_s)}
    total = sum(end for _, end in spans.values())
    log.warning("content names a data key written before keys named their place: "
                "reading %s once (%d records) to find such keys", KEYS, total)
    index: dict[str, tuple[int, int]] = {}
    started = time.monotonic()
    for n, record in enumerate(iter_spans(bootstrap, KEYS, spans), 1):
        parsed = parse_record_key(record.key)
        if parsed is not None and record.value is not None \
                and b'"v": 2' not in record.value[:8]:
            index[parsed[1]] = (record.position.partition, record.position.offset)
        if n % 100_000 == 0:
            log.info("read %d of %d records of %s (%.0f s)", n, total, KEYS,
                     time.monotonic() - started)
    log.warning("found %d data keys without a place in %s", len(index), KEYS)
    return index
