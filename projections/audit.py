"""The full event history of one session, read straight from the log: its durable record
(every topic of it), what the model was given for each turn (rebuilt from that record
alone, ``schemas.history``, and checked against the digest the gateway wrote), and,
while the live stream keeps them, its turns' deltas."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.codec import Codec, DecodeError, Position, conversation_key, parse_live
from pipeline.kafka import LogReader, Record
from pipeline.partitioning import partition_for
from pipeline.topics import CLOCK_SKEW_MS, CONVERSATION_TOPICS, LIVE, PROMPTS
from schemas import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
)
from schemas.history import History, digest, session_inputs
from schemas.live import Delta, StreamItem, entries


@dataclass(frozen=True)
class Entry:
    position: Position
    event: Event | None
    error: str | None = None
    # For a prompt: the model's whole input, rebuilt from the log (None: its history
    # names records the log no longer holds).
    model_input: History | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"topic": self.position.topic,
                               "partition": self.position.partition,
                               "offset": self.position.offset}
        if self.event is not None:
            out["event"] = self.event.model_dump(mode="json")
        else:
            out["error"] = self.error
        if isinstance(self.event, PromptSubmitted):
            out["model_input"] = None if self.model_input is None else [
                m.model_dump(mode="json") for m in self.model_input]
            out["history_digest_matches"] = _digest_matches(self.event, self.model_input)
        return out


@dataclass(frozen=True)
class LiveEntry:
    """A delta (or a start, end or failure) of one of the session's turns in chat.live."""

    position: Position
    index: int
    request_id: str
    item: StreamItem

    def to_json(self) -> dict[str, Any]:
        return {"topic": self.position.topic, "partition": self.position.partition,
                "offset": self.position.offset, "index": self.index,
                "request_id": self.request_id, "entry": type(self.item).__name__,
                **_item_json(self.item)}


def _digest_matches(prompt: PromptSubmitted, model_input: History | None) -> bool | None:
    if prompt.history_digest is None or model_input is None:
        return None
    return digest(model_input[:prompt.history_len]) == prompt.history_digest


def _scan(consumer: LogReader, starts: dict[tuple[str, int], int],
          keep: Callable[[Record], bool], ends: dict[tuple[str, int], int] | None = None
          ) -> list[Record]:
    """The committed records ``keep`` takes, of these partitions from these offsets up to
    the end each has now (or ``ends``): only those are held, whatever else is read."""
    if ends is None:
        ends = {tp: consumer.watermarks_sync(*tp)[1] for tp in starts}
    todo = {tp: start for tp, start in starts.items() if start < ends[tp]}
    if not todo:
        return []
    consumer.assign_at_sync(todo)
    kept = []
    remaining = dict(todo)
    while remaining:
        batch = consumer.poll_batch_sync(5000, 0.2)
        kept += [r for r in batch if r.position.offset < ends[(r.position.topic,
                                                               r.position.partition)]
                 and keep(r)]
        # Transaction markers are never delivered: the position says when a topic is done.
        for tp, position in consumer.positions_sync(list(remaining)).items():
            if position >= ends[tp]:
                del remaining[tp]
    return kept


def read_history(consumer: LogReader, codec: Codec, conversation_id: uuid.UUID,
                 since_ms: int | None = None) -> tuple[list[Entry], list[LiveEntry]]:
    """Every record keyed by the conversation, from every topic of the durable record
    (from ``since_ms`` on, if given: its first event's time), and its turns' entries in
    the live stream, read from shortly before each turn started to shortly after it
    ended (runs on the consumer thread). A conversation lives in one partition of each
    topic, so only those are read; and only its records are decoded and held. Its
    content is opened with ``codec``."""
    key = conversation_key(conversation_id)
    partitions = len(consumer.partitions_sync(PROMPTS))
    p = partition_for(key, partitions)
    starts = {(t, p): consumer.offset_for_time_sync(t, p, since_ms - CLOCK_SKEW_MS)
              if since_ms is not None else consumer.watermarks_sync(t, p)[0]
              for t in CONVERSATION_TOPICS}
    entries_: list[Entry] = []
    for record in _scan(consumer, starts, lambda r: r.key == key):
        try:
            entries_.append(Entry(record.position, codec.decode(record.value)))
        except DecodeError as exc:
            entries_.append(Entry(record.position, None, str(exc)))
    prompts = [(e.position.offset, e.event) for e in entries_
               if isinstance(e.event, PromptSubmitted)]
    ends: dict[str, GenerationFinished | GenerationFailed] = {}
    for e in sorted(entries_, key=lambda e: e.position.offset):
        if isinstance(e.event, (GenerationFinished, GenerationFailed)):
            ends.setdefault(e.event.request_id, e.event)
    inputs = session_inputs(prompts, ends)
    entries_ = [Entry(e.position, e.event, e.error, inputs.get(e.event.request_id))
                if isinstance(e.event, PromptSubmitted) else e for e in entries_]
    refs = {offset: prompt.request_id for offset, prompt in prompts}
    live: list[LiveEntry] = []
    span = _live_span(consumer, p, entries_)
    if refs and span is not None:
        for record in _scan(consumer, {(LIVE, p): span[0]}, lambda _r: True,
                            {(LIVE, p): span[1]}):
            try:
                batch = parse_live(record.value)
                if not any(ref in refs for _, ref, _ in entries(batch)):
                    continue  # other conversations' turns: their keys are not fetched
                batch = codec.open_live(batch, refs)
            except DecodeError:
                continue
            live += [LiveEntry(record.position, index, refs[ref], item)
                     for index, ref, item in entries(batch) if ref in refs]
    entries_.sort(key=lambda e: (e.event.occurred_at.timestamp() if e.event else 0.0,
                                 e.position.topic != PROMPTS, e.position.offset))
    return entries_, live


def _live_span(consumer: LogReader, partition: int,
               entries_: list[Entry]) -> tuple[int, int] | None:
    """Where the conversation's turns lie in the live stream: from shortly before the
    first started (by its worker's clock) to shortly after the last ended, or to the
    end if one runs still."""
    starts = [e.event.occurred_at for e in entries_ if isinstance(e.event, GenerationStarted)]
    if not starts:
        return None
    ended = {e.event.request_id for e in entries_
             if isinstance(e.event, (GenerationFinished, GenerationFailed))}
    running = any(isinstance(e.event, GenerationStarted) and e.event.request_id not in ended
                  for e in entries_)
    low, high = consumer.watermarks_sync(LIVE, partition)
    first = int(min(starts).timestamp() * 1000) - CLOCK_SKEW_MS
    start = max(consumer.offset_for_time_sync(LIVE, partition, first), low)
    if running:
        return start, high
    last = max(e.event.occurred_at for e in entries_ if e.event is not None)
    end = consumer.offset_for_time_sync(LIVE, partition,
                                        int(last.timestamp() * 1000) + CLOCK_SKEW_MS)
    return start, max(start, end)


def format_text(entries_: list[Entry], live: list[LiveEntry] | None = None,
                deltas: bool = False) -> str:
    """One line per event; each prompt's model input summarised, and each turn's deltas
    (legacy ``TokenDelta`` events, or entries of the live stream) summarised per turn
    unless ``deltas``."""
    lines = []
    pending: list[Entry] = []

    def flush() -> None:
        if pending:
            first, last = pending[0], pending[-1]
            assert isinstance(first.event, TokenDelta) and isinstance(last.event, TokenDelta)
            chars = sum(len(e.event.text) for e in pending if isinstance(e.event, TokenDelta))
            lines.append(f"{'':32}  {str(first.position) + '..' + str(last.position.offset):34}"
                         f"  TokenDelta x{len(pending)} (seq {first.event.seq}..{last.event.seq},"
                         f" {chars} chars)")
            pending.clear()

    for entry in entries_:
        event = entry.event
        if isinstance(event, TokenDelta) and not deltas:
            pending.append(entry)
            continue
        flush()
        if event is None:
            lines.append(f"{'?':32}  {entry.position!s:34}  UNDECODABLE: {entry.error}")
            continue
        lines.append(f"{event.occurred_at.isoformat():32}  {entry.position!s:34}  "
                     f"{event.type} {_summary(event)}")
        if isinstance(event, PromptSubmitted):
            lines.append(f"{'':32}  {'':34}  {_input_summary(event, entry.model_input)}")
    flush()
    if live:
        lines.append("")
        lines.append(f"{LIVE} (kept for a bounded window):")
        lines += _live_lines(live, deltas)
    return "\n".join(lines)


def _input_summary(prompt: PromptSubmitted, model_input: History | None) -> str:
    if model_input is None:
        return "model input: not rebuildable (its history names records the log lacks)"
    matches = _digest_matches(prompt, model_input)
    check = {True: "matches", False: "DOES NOT MATCH", None: "not given"}[matches]
    chars = sum(len(m.content) for m in model_input)
    return (f"model input: {len(model_input)} messages, {chars} chars "
            f"({prompt.history_len} of history; the gateway's digest {check})")


def _live_lines(live: list[LiveEntry], deltas: bool) -> list[str]:
    if deltas:
        return [f"{'':32}  {str(e.position) + '#' + str(e.index):34}  {e.request_id} "
                f"{type(e.item).__name__} {json.dumps(_item_json(e.item), ensure_ascii=False)}"
                for e in live]
    lines = []
    for request_id in dict.fromkeys(e.request_id for e in live):
        turn = [e for e in live if e.request_id == request_id]
        texts = [e.item for e in turn if isinstance(e.item, Delta)]
        seqs = [d.seq for d in texts]
        lines.append(f"{'':32}  {str(turn[0].position) + '..' + str(turn[-1].position.offset):34}"
                     f"  {request_id}: {len(turn)} entries, deltas "
                     f"{min(seqs, default=0)}..{max(seqs, default=-1)} "
                     f"({sum(len(d.text) for d in texts)} chars)")
    return lines


def _item_json(item: StreamItem) -> dict[str, Any]:
    out = {}
    for name in item.__slots__:
        value = getattr(item, name)
        out[name] = value.model_dump() if hasattr(value, "model_dump") else value
    return out


def _summary(event: Event) -> str:
    data = event.model_dump(mode="json", exclude={"type", "v", "event_id", "conversation_id",
                                                   "occurred_at", "tenant"})
    for name in ("messages", "history"):
        if data.get(name) is not None:
            data[name] = f"{len(data[name])} messages"
    if data.get("sealed") is not None:  # a box this process cannot open
        data["sealed"] = "content erased: its data keys were destroyed"
    if "text" in data and len(data["text"]) > 60:
        data["text"] = data["text"][:57] + "..."
    return json.dumps(data, ensure_ascii=False)


def audit(bootstrap: str, codec: Codec, conversation_id: uuid.UUID,
          since_ms: int | None = None) -> tuple[list[Entry], list[LiveEntry]]:
    import asyncio

    async def run() -> tuple[list[Entry], list[LiveEntry]]:
        # Only the session's records are kept: a small prefetch keeps the rest brief.
        consumer = LogReader(bootstrap, f"audit-{uuid.uuid4().hex[:12]}", "audit",
                             **{"queued.max.messages.kbytes": 8192})
        try:
            return await consumer.call(read_history, consumer, codec, conversation_id,
                                       since_ms)
        finally:
            await consumer.close()

    return asyncio.run(run())
