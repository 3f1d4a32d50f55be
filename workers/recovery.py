"""What earlier attempts left in the log, so a new owner can resume a turn exactly.

When a worker is handed a prompt partition, it reads the recent records of the same
partition of ``chat.live`` and ``chat.generations`` (where the same conversations
live) and folds them, per turn, into: the highest attempt seen, the deltas already
emitted (by ``seq``), and whether the turn already ended. A turn that ended is not run
again; a turn that did not is continued after its emitted tokens, under the next
attempt, with ``seq`` carrying on, so readers see no gap and no duplicate.

* ``LiveFolder`` folds ``chat.live``: turns by their reference (the prompt's offset),
  only those at or past the partition's committed offset (no turn below it is
  unfinished).
* ``LogFolder`` folds ``chat.generations``: turns by request id, for their ends, and
  for the ``TokenDelta`` events of turns written before the live stream. It takes the
  records one at a time and decodes only what resuming needs: each record's request
  id is read from its bytes, the turns' terminal events are decoded to learn which
  ended, and the other records of ended turns are dropped undecoded as soon as their
  turn's end is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pipeline.codec import Codec, DecodeError, parse_or_none
from schemas import (
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    TokenDelta,
)
from schemas.live import TERMINAL, Delta, Start, entries


@dataclass
class Recovered:
    attempt: int = 0
    ended: bool = False
    deltas: dict[int, Delta] = field(default_factory=dict)
    # Deltas found only in chat.generations (written before the live stream): the next
    # attempt writes them to the live stream again, so its readers have the whole turn.
    legacy: bool = False

    def emitted(self) -> list[Delta]:
        """The deltas from seq 0 on, as long as they run without a gap."""
        out: list[Delta] = []
        while len(out) in self.deltas:
            out.append(self.deltas[len(out)])
        return out

    def merged(self, live: Recovered) -> Recovered:
        """This (from ``chat.generations``) and what ``live`` found of the same turn."""
        deltas = {**self.deltas, **live.deltas}
        return Recovered(max(self.attempt, live.attempt), self.ended or live.ended, deltas,
                         legacy=any(seq not in live.deltas for seq in self.deltas))


def fold(events: list[Event]) -> dict[str, Recovered]:
    """Per request id, what ``chat.generations`` says about its generation so far."""
    state: dict[str, Recovered] = {}
    for event in events:
        if isinstance(event, GenerationStarted):
            rec = state.setdefault(event.request_id, Recovered())
            rec.attempt = max(rec.attempt, event.attempt)
        elif isinstance(event, TokenDelta):
            rec = state.setdefault(event.request_id, Recovered())
            rec.deltas.setdefault(event.seq, Delta(event.seq, event.text, event.token_ids))
            rec.legacy = True
        elif isinstance(event, (GenerationFinished, GenerationFailed)):
            state.setdefault(event.request_id, Recovered()).ended = True
    return state


class LiveFolder:
    """Folds ``chat.live`` records of the partitions in ``first_ref`` (partition -> the
    lowest reference of interest, its committed prompt offset): per ``(partition, ref)``,
    what the turn's entries say. A turn seen to end keeps nothing but that. ``codec``
    opens the text a turn resumes from."""

    def __init__(self, first_ref: dict[int, int], codec: Codec) -> None:
        self._first = first_ref
        self._codec = codec
        self._found: dict[tuple[int, int], Recovered] = {}
        self.undecodable = 0

    def add(self, partition: int, value: bytes | None) -> None:
        first = self._first.get(partition)
        if first is None:
            return
        try:
            batch = self._codec.decode_live(value)
        except DecodeError:
            self.undecodable += 1  # nothing to resume from it
            return
        for _, ref, item in entries(batch):
            if ref < first:
                continue
            rec = self._found.setdefault((partition, ref), Recovered())
            if rec.ended:
                continue
            if isinstance(item, Delta):
                rec.deltas.setdefault(item.seq, item)
            elif isinstance(item, Start):
                rec.attempt = max(rec.attempt, item.attempt)
            elif isinstance(item, TERMINAL):
                rec.ended, rec.deltas = True, {}

    def result(self) -> dict[tuple[int, int], Recovered]:
        return self._found


@dataclass
class Found:
    """What a takeover found: turns of ``chat.generations`` by request id, turns of
    ``chat.live`` by (partition, reference)."""

    by_request: dict[str, Recovered] = field(default_factory=dict)
    by_ref: dict[tuple[int, int], Recovered] = field(default_factory=dict)

    def take(self, request_id: str, partition: int, ref: int) -> Recovered | None:
        """What the log holds of one turn (None: nothing), taken out."""
        live = self.by_ref.pop((partition, ref), None)
        durable = self.by_request.pop(request_id, None)
        if durable is None:
            return live
        return durable.merged(live) if live is not None else durable

    def describe(self) -> str:
        """What was found, for the log."""
        return (f"{len(self.by_ref)} turns in the live stream "
                f"({sum(not r.ended for r in self.by_ref.values())} unfinished), "
                f"{len(self.by_request)} in the durable record "
                f"({sum(not r.ended for r in self.by_request.values())} unfinished)")


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


class LogFolder:
    """``fold`` over the values of ``chat.generations`` records fed in log order, one at a
    time, holding only what resuming needs: the raw records of turns not (yet) seen to
    end, and the ids of those that ended. A window of a busy log holds millions of
    records, nearly all of ended turns; kept whole they took a worker taking over past
    10 GB. Their content stays sealed (``parse``): resuming needs ids, deltas of the
    clear legacy events and ends, never a reply's text."""

    def __init__(self) -> None:
        self._ended: set[str] = set()
        self._open: dict[str, list[bytes]] = {}  # raw records of turns not seen to end
        self._loose: list[Event] = []  # records whose request id the bytes do not show

    def add(self, value: bytes | None) -> None:
        peek = _peek(value)
        if peek is None:
            event = parse_or_none(value)
            if event is not None:
                self._loose.append(event)
            return
        request_id, terminal = peek
        if request_id in self._ended:
            return
        if terminal:  # decoded to be sure: a turn marked ended is skipped
            event = parse_or_none(value)
            if isinstance(event, (GenerationFinished, GenerationFailed)):
                self._ended.add(event.request_id)
                self._open.pop(event.request_id, None)
                return
        assert value is not None  # a None value has no request id to peek
        self._open.setdefault(request_id, []).append(value)

    @property
    def held(self) -> int:
        """Records held undecoded: those of turns not seen to end."""
        return sum(map(len, self._open.values()))

    def result(self) -> dict[str, Recovered]:
        events = list(self._loose)
        for values in self._open.values():
            events += [e for e in map(parse_or_none, values) if e is not None]
        state = fold(events)
        for request_id in self._ended:
            state[request_id] = Recovered(ended=True)
        return state


def fold_values(values: Iterable[bytes | None]) -> dict[str, Recovered]:
    """``fold`` over the values of ``chat.generations`` records, in log order, decoding
    only terminal events and the records of turns that did not end; ``values`` are
    folded as they come (``LogFolder``), so a generator over a scan is never held whole."""
    folder = LogFolder()
    for value in values:
        folder.add(value)
    return folder.result()
