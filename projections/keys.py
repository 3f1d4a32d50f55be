"""What a record of ``chat.keys`` means for the store: the index of data keys
(``data_keys``), less their secrets. Pure: no I/O.

A key's row says where its record lies (its reference), whose it is, and when it was
made; a tombstone deletes it. A gateway finds a conversation's key there, ``pipeline
erase --user`` a user's conversations, and the projector the keys of a deleted
conversation, to destroy (``projections.projector``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.kafka import Record
from pipeline.kek import KeyRef, key_info, parse_record_key
from projections.projection import Write, write

_ADD = """
INSERT INTO data_keys (key_id, short_id, conversation_id, tenant, user_digest, created_at)
VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (key_id) DO NOTHING
"""
_DESTROYED = "DELETE FROM data_keys WHERE conversation_id = %s AND short_id = %s"
# The keys of deleted conversations among these, to destroy: a deletion read in this
# batch, or a key made for a conversation deleted already (its writer had not learnt it).
DOOMED = """
SELECT d.key_id, d.conversation_id, c.tenant FROM data_keys d
JOIN conversations c ON c.id = d.conversation_id
WHERE c.deleted AND d.conversation_id = ANY(%s)
"""
DROP = "DELETE FROM data_keys WHERE key_id = ANY(%s)"


def key_writes(record: Record) -> list[Write]:
    """The writes for one record of ``chat.keys`` (``ValueError``: it is not a key's)."""
    if record.value is None:
        parsed = parse_record_key(record.key)
        if parsed is None:
            raise ValueError(f"a tombstone keyed {record.key!r}: not a data key's")
        return [write(_DESTROYED, parsed)]
    info = key_info(record.key, record.value)
    ref = str(KeyRef(info.short_id, record.position.partition, record.position.offset)) \
        if info.placed else info.short_id
    try:
        made = datetime.fromtimestamp((info.at_ms or record.timestamp_ms) / 1000, UTC)
    except (OverflowError, OSError, ValueError):  # a time no clock gives
        raise ValueError(f"made at {info.at_ms} ms: not a time") from None
    added = write(_ADD, (ref, info.short_id, info.conversation_id, info.tenant,
                         info.user_digest, made))
    if info.orig is not None:  # wrapped anew by a rotation: its row names this record now
        return [write(_DESTROYED, (info.conversation_id, info.short_id)), added]
    return [added]
