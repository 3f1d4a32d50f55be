"""What earlier attempts left in the log, so a new owner can resume a turn exactly.

When a worker is handed a prompt partition, it reads the recent records of the
same partition of ``chat.generations`` (where the same conversations live) and
folds them, per request, into: the highest attempt seen, the token deltas already
emitted (by ``seq``), and whether the turn already ended. A turn that ended is not
run again; a turn that did not is continued after its emitted tokens, under the
next attempt, with ``seq`` carrying on, so readers see no gap and no duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
