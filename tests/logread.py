"""Read a topic from the beginning up to its current end, as an auditor would: committed
records only (``isolation.level=read_committed``), unless asked for everything; content
opened with the keyring of the cluster read (``hold``), as an auditor holding it does."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from pipeline.codec import CLEAR, Codec, DecodeError, Position
from pipeline.keystore import Keyring
from pipeline.topics import GENERATIONS, LIVE, PROMPTS
from schemas import Event, GenerationFailed, GenerationFinished, PromptSubmitted
from schemas.history import History, session_inputs
from schemas.live import Delta, Start, StreamItem, entries

RawRecord = tuple[Position, bytes | None, dict[str, bytes]]
Marks = dict[str, dict[int, int]]  # topic -> partition -> offset
# The codec of each cluster's keyring the tests hold, by its bootstrap.
_held: dict[str, Codec] = {}


@contextlib.contextmanager
def hold(bootstrap: str, keyring: Keyring) -> Iterator[Keyring]:
    """Read the content of the cluster at ``bootstrap`` with ``keyring``'s keys."""
    _held[bootstrap] = codec = keyring.codec
    try:
        yield keyring
    finally:
        if _held.get(bootstrap) is codec:
            del _held[bootstrap]


def codec_of(bootstrap: str) -> Codec:
    """What the cluster's content is read with: its keyring's codec if the tests hold it,
    else one that opens nothing."""
    return _held.get(bootstrap, CLEAR)


def read_records(bootstrap: str, topic: str, committed: bool = True,
                 timeout: float = 30.0, since: Marks | None = None,
                 stable: bool = False) -> list[RawRecord]:
    """The topic's records from ``since`` (each partition's offset; the beginning if
    None) to its end. A committed read waits for open transactions to end, unless
    ``stable``: then it stops at the last stable offset (what is committed now), so a
    writer frozen mid-transaction does not hold it."""
    isolation = "read_committed" if committed else "read_uncommitted"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "enable.auto.commit": False, "isolation.level": isolation})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        ends = end_offsets(bootstrap, topic, stable=stable and committed)
        starts = (since or {}).get(topic, {})
        consumer.assign([TopicPartition(topic, p, starts.get(p, 0)) for p in parts])
        out = []
        remaining = {p for p, end in ends.items() if end > starts.get(p, 0)}
        deadline = time.monotonic() + timeout
        while remaining:
            assert time.monotonic() < deadline, f"timed out reading {topic}"
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                headers = {k: v for k, v in (msg.headers() or [])}
                out.append((Position(topic, msg.partition(), msg.offset()), msg.value(),
                            headers))
            # Transaction markers and aborted records are never delivered: the position
            # tells when a partition has been read to its end.
            for tp in consumer.position([TopicPartition(topic, p) for p in remaining]):
                if tp.offset >= ends[tp.partition]:
                    remaining.discard(tp.partition)
        return out
    finally:
        consumer.close()


def read_events(bootstrap: str, topic: str, committed: bool = True,
                since: Marks | None = None, stable: bool = False,
                ) -> list[tuple[Position, Event]]:
    events = []
    codec = codec_of(bootstrap)
    for position, value, _ in read_records(bootstrap, topic, committed,
                                           since=since, stable=stable):
        try:
            events.append((position, codec.decode(value)))
        except DecodeError:
            continue
    return events


def end_offsets(bootstrap: str, topic: str, stable: bool = False) -> dict[int, int]:
    """Each partition's true end (its high watermark, open transactions included), or
    if ``stable`` its last stable offset (where the first open transaction begins)."""
    isolation = "read_committed" if stable else "read_uncommitted"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "isolation.level": isolation})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in parts}
    finally:
        consumer.close()


def marks(bootstrap: str, *topics: str) -> Marks:
    """The topics' ends now: read from them to see only what is written after."""
    return {topic: end_offsets(bootstrap, topic) for topic in topics}


@dataclass(frozen=True)
class LiveItem:
    """An entry of chat.live, with the turn it belongs to."""

    position: Position
    index: int
    request_id: str
    item: StreamItem
    worker: str  # the worker that wrote its record


def read_live(bootstrap: str, committed: bool = True, since: Marks | None = None,
              stable: bool = False) -> list[LiveItem]:
    """Every entry of chat.live (from ``since``, as read_records), in log order per
    partition, with its turn's request id (from the turn's start entry, or from the
    prompt its reference names)."""
    prompts = {(p.partition, p.offset): e.request_id
               for p, e in read_events(bootstrap, PROMPTS, since=since)
               if isinstance(e, PromptSubmitted)}
    out = []
    codec = codec_of(bootstrap)
    for position, value, _ in read_records(bootstrap, LIVE, committed, since=since,
                                           stable=stable):
        try:
            batch = codec.decode_live(value)
        except DecodeError:
            continue
        for index, ref, item in entries(batch):
            request_id = item.request_id if isinstance(item, Start) else \
                prompts.get((position.partition, ref), f"?{ref}")
            out.append(LiveItem(position, index, request_id, item, batch.worker))
    return out


def deltas_of(bootstrap: str, request_id: str) -> list[Delta]:
    """A turn's deltas in the live stream, in log order (copies included)."""
    return [i.item for i in read_live(bootstrap)
            if i.request_id == request_id and isinstance(i.item, Delta)]


def model_input(bootstrap: str, request_id: str) -> History | None:
    """What the model was given for a turn, rebuilt from the durable record alone."""
    prompts = [(p.offset, e) for p, e in read_events(bootstrap, PROMPTS)
               if isinstance(e, PromptSubmitted)]
    conversation = next(e.conversation_id for _, e in prompts if e.request_id == request_id)
    ends: dict[str, GenerationFinished | GenerationFailed] = {}
    for _, e in read_events(bootstrap, GENERATIONS):
        if isinstance(e, (GenerationFinished, GenerationFailed)) and \
                e.conversation_id == conversation:
            ends.setdefault(e.request_id, e)
    return session_inputs([(o, e) for o, e in prompts if e.conversation_id == conversation],
                          ends).get(request_id)
