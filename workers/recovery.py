"""What earlier attempts left in the log, so a new owner can resume a turn exactly.

When a worker is handed a prompt partition, it reads the recent records of the
same partition of ``chat.generations`` (where the same conversations live) and
folds them, per request, into: the highest attempt seen, the token deltas already
emitted (by ``seq``), and whether the turn already ended. A turn that ended is not
run again; a turn that did not is continued after its emitted tokens, under the
next attempt, with ``seq`` carrying on, so readers see no gap and no duplicate.

The scan runs on every assignment, over every record of the window, so ``from_log``
decodes only what resuming needs: each record's request id is read from its bytes,
the turns' terminal events are decoded to learn which ended, and the other records of
ended turns (nearly all of them) are never decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.codec import DecodeError, decode
from schemas import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    TokenDelta,
)


@dataclass
class Recovered:
    attempt: int = 0
    ended: bool = False
    deltas: dict[int, TokenDelta] = field(default_factory=dict)

    def emitted(self) -> list[TokenDelta]:
        """The deltas from seq 0 on, as long as they run without a gap."""
        out: list[TokenDelta] = []
        while len(out) in self.deltas:
            out.append(self.deltas[len(out)])
        return out


def fold(events: list[Event]) -> dict[str, Recovered]:
    """Per request id, what the log says about its generation so far."""
    state: dict[str, Recovered] = {}
    for event in events:
        if isinstance(event, GenerationStarted):
            rec = state.setdefault(event.request_id, Recovered())
            rec.attempt = max(rec.attempt, event.attempt)
        elif isinstance(event, TokenDelta):
            rec = state.setdefault(event.request_id, Recovered())
            rec.deltas.setdefault(event.seq, event)
        elif isinstance(event, (GenerationFinished, GenerationFailed)):
            state.setdefault(event.request_id, Recovered()).ended = True
    return state


_REQUEST = b'"request_id":"'
_TERMINAL = (b'"type":"GenerationFinished"', b'"type":"GenerationFailed"')


def _peek(value: bytes | None) -> tuple[str, bool] | None:
    """(request id, whether the record looks terminal), read from the bytes ``encode``
    writes (``request_id`` is the first string field named so, and quotes inside JSON
    strings are escaped); None for bytes not laid out that way."""
    if value is None:
        return None
    start = value.find(_REQUEST)
    if start < 0:
        return None
    start += len(_REQUEST)
    end = value.find(b'"', start)
    if end < 0 or b"\\" in value[start:end]:
        return None
    try:
        request_id = value[start:end].decode()
    except UnicodeDecodeError:
        return None
    return request_id, any(marker in value for marker in _TERMINAL)


def _decode(value: bytes | None) -> Event | None:
    try:
        return decode(value)
    except DecodeError:
        return None  # not an event: nothing to resume from it


def from_log(values: Sequence[bytes | None]) -> dict[str, Recovered]:
    """``fold`` over the values of ``chat.generations`` records, in log order, decoding
    only terminal events and the records of turns that did not end."""
    peeked = [_peek(v) for v in values]
    ended = set()
    for value, peek in zip(values, peeked, strict=True):
        if peek is not None and peek[1]:  # decoded to be sure: a turn marked ended is skipped
            event = _decode(value)
            if isinstance(event, (GenerationFinished, GenerationFailed)):
                ended.add(event.request_id)
    events = []
    for value, peek in zip(values, peeked, strict=True):
        if peek is None or peek[0] not in ended:
            event = _decode(value)
            if event is not None:
                events.append(event)
    state = fold(events)
    for request_id in ended:
        state[request_id] = Recovered(ended=True)
    return state
