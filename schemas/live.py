"""The live stream (``chat.live``): what the running turns of one partition produced in
one window, many turns to a record. No I/O.

The durable record (``chat.prompts``, ``chat.control``, ``chat.generations``) keeps what
the store and an auditor need, forever: prompts, and each turn's start and end with its
whole text. The live stream keeps what a client following a turn needs, its text as
it comes, for a bounded window (``PIPELINE_LIVE_RETENTION_MS``): resuming a stream,
and a worker taking a turn over, read it back. A worker writes both in one Kafka
transaction, so a replaced worker's deltas and its turns' ends are fenced together.

One ``LiveBatch`` record holds, for one partition (the conversations' partition
number in every chat topic), the entries its turns made since the worker's last
record there. Entries are arrays, to keep a token's cost near its text's:

* ``starts``: ``[ref, attempt, request_id]``: an attempt at the turn began (its first
  token is among the deltas). It names the turn's request id once per attempt; the
  entries after it name the turn by ``ref`` alone.
* ``deltas``: ``[ref, seq, text, [token ids]]``: ``seq`` counts from 0 with no gap per
  turn, across attempts; a reader drops a ``(turn, seq)`` it has seen.
* ``ends``: ``[ref, deltas, finish_reason, prompt_tokens, completion_tokens]``.
* ``failures``: ``[ref, code, message]``.
* ``sealed``: ``[ref, key id, box]``: the text and token ids of that turn's deltas in
  this record, sealed with its conversation's data key (``pipeline.sealing``): a JSON
  array of ``[text, [token ids]]``, one per delta of the turn, in order. Those deltas
  are written with their text empty and no token ids; a reader holding the key puts
  them back (``pipeline.codec.Codec.decode_live``).

``ref`` is the turn's accepted prompt's offset in its partition of ``chat.prompts``:
unique in the partition, known to the worker that runs the turn and to every reader
of the durable record (``GenerationStarted.ref``). A record's entries are read in the
order starts, deltas, ends, failures; a turn's entries keep their order in it. An
entry's position is its record's offset and its index in that order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from schemas.events import (
    FinishReason,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    Name,
    TokenDelta,
    Usage,
)

_INT32 = 2**31 - 1
Ref = Annotated[int, Field(ge=0, le=2**63 - 1)]
Count = Annotated[int, Field(ge=0, le=_INT32)]
RequestId = Name
TokenId = Annotated[int, Field(ge=0, le=_INT32)]

LiveStart = tuple[Ref, Count, RequestId]
LiveDelta = tuple[Ref, Count, str, tuple[TokenId, ...]]
LiveEnd = tuple[Ref, Count, FinishReason, Count, Count]
LiveFailure = tuple[Ref, Name, str]


class LiveBatch(BaseModel):
    """One record of ``chat.live`` (see the module)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    type: Literal["LiveBatch"] = "LiveBatch"
    v: int = 1
    worker: Name
    # When the worker wrote the record (Unix time, ms).
    at: int = Field(ge=0, le=253402300799999)
    starts: tuple[LiveStart, ...] = ()
    deltas: tuple[LiveDelta, ...] = ()
    ends: tuple[LiveEnd, ...] = ()
    failures: tuple[LiveFailure, ...] = ()
    sealed: tuple[tuple[Ref, Name, str], ...] = ()


LIVE_ADAPTER: TypeAdapter[LiveBatch] = TypeAdapter(LiveBatch)
_ENCODER = msgspec.json.Encoder()


def write_batch(worker: str, at_ms: int, starts: Sequence[LiveStart],
                deltas: Sequence[LiveDelta], ends: Sequence[LiveEnd],
                failures: Sequence[LiveFailure], sealed: Sequence[tuple[int, str, str]]
                ) -> bytes:
    """A ``LiveBatch`` record's value, from its entries as the arrays it holds: no model
    is built (a worker writes one per partition per engine step). ``LIVE_ADAPTER``
    reads it back; ``tests/test_contract.py`` holds it to the published schema."""
    return _ENCODER.encode({
        "type": "LiveBatch", "v": 1, "worker": worker, "at": at_ms, "starts": starts,
        "deltas": deltas, "ends": ends, "failures": failures, "sealed": sealed})


# -- one turn's stream, as every reader sees it ----------------------------------------
@dataclass(frozen=True, slots=True)
class Start:
    attempt: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Delta:
    seq: int
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class End:
    deltas: int
    finish_reason: FinishReason
    usage: Usage


@dataclass(frozen=True, slots=True)
class Failure:
    code: str
    message: str


StreamItem = Start | Delta | End | Failure
TERMINAL = (End, Failure)


def entries(batch: LiveBatch) -> Iterator[tuple[int, int, StreamItem]]:
    """``(index, ref, item)`` for each entry of ``batch``, in reading order."""
    index = 0
    for ref, attempt, request_id in batch.starts:
        yield index, ref, Start(attempt, request_id)
        index += 1
    for ref, seq, text, token_ids in batch.deltas:
        yield index, ref, Delta(seq, text, token_ids)
        index += 1
    for ref, deltas, reason, prompt_tokens, completion_tokens in batch.ends:
        yield index, ref, End(deltas, reason, Usage(prompt_tokens=prompt_tokens,
                                                    completion_tokens=completion_tokens))
        index += 1
    for ref, code, message in batch.failures:
        yield index, ref, Failure(code, message)
        index += 1


def from_event(event: object) -> StreamItem | None:
    """The stream item a durable generation event stands for: how readers take a turn
    written before the live stream (its deltas are ``TokenDelta`` events)."""
    if isinstance(event, TokenDelta):
        return Delta(event.seq, event.text, event.token_ids)
    if isinstance(event, GenerationStarted):
        return Start(event.attempt, event.request_id)
    if isinstance(event, GenerationFinished):
        return End(event.deltas, event.finish_reason, event.usage)
    if isinstance(event, GenerationFailed):
        return Failure(event.code, event.message)
    return None
