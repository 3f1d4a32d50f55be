"""Low-watermark offset tracking: commit only below the oldest prompt still in flight.

Each commit also says, in the group's offset metadata, how much of the partition waits
(``pipeline.waiting``): a gateway's admission counts that, not the distance from the
committed offset, which a long turn holds back."""

from __future__ import annotations

import threading

from pipeline.codec import TP
from pipeline.waiting import describe


class OffsetTracker:
    """Per partition, the offsets taken but not yet done.

    ``committable()`` gives, per partition, the next offset it is safe to commit: the
    lowest offset still in flight, or one past the highest offset seen when none is.
    Thread-safe: rebalance callbacks read it from the consumer's thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[TP, set[int]] = {}
        self._waiting: dict[TP, set[int]] = {}  # taken, to be run here, not started
        self._next: dict[TP, int] = {}
        self._committed: dict[TP, int] = {}
        self._told: dict[TP, str] = {}  # the metadata of the last commit that went through
        self._telling: dict[TP, str] = {}  # the metadata of the commit under way

    def start(self, tp: TP, offset: int) -> None:
        """A partition just assigned, read from ``offset`` on."""
        with self._lock:
            self._next.setdefault(tp, offset)
            self._committed.setdefault(tp, offset)

    def taken(self, tp: TP, offset: int) -> None:
        with self._lock:
            self._in_flight.setdefault(tp, set()).add(offset)
            self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def done(self, tp: TP, offset: int) -> None:
        with self._lock:
            self._in_flight.get(tp, set()).discard(offset)
            self._waiting.get(tp, set()).discard(offset)

    def queued(self, tp: TP, offset: int) -> None:
        """A prompt taken to run here waits for a slot in the engine."""
        with self._lock:
            self._waiting.setdefault(tp, set()).add(offset)

    def started(self, tp: TP, offset: int) -> None:
        with self._lock:
            self._waiting.get(tp, set()).discard(offset)

    def describe(self, tp: TP) -> str:
        """The offset metadata a commit of ``tp`` carries now (see the module)."""
        with self._lock:
            text = describe(self._next.get(tp, 0), len(self._waiting.get(tp, ())))
            self._telling[tp] = text
            return text

    def stale_descriptions(self) -> bool:
        """Whether what the last commits said of the waiting work has changed since."""
        with self._lock:
            return any(self._told.get(tp) != describe(nxt, len(self._waiting.get(tp, ())))
                       for tp, nxt in self._next.items())

    def advance(self, positions: dict[TP, int]) -> None:
        """The consumer's positions: past records it never delivers (transaction markers,
        aborted records), which a commit may pass too."""
        with self._lock:
            for tp, position in positions.items():
                if tp in self._next and position > self._next[tp]:
                    self._next[tp] = position

    def committable(self) -> dict[TP, int]:
        """Safe positions that moved since the last ``mark_committed``."""
        out = {}
        with self._lock:
            for tp, nxt in self._next.items():
                pending = self._in_flight.get(tp)
                safe = min(pending) if pending else nxt
                if self._committed.get(tp) != safe:
                    out[tp] = safe
        return out

    def positions(self) -> dict[TP, int]:
        """The safe position of every partition (moved or not): what a transaction
        commits, so the broker checks this worker still owns them."""
        with self._lock:
            return {tp: min(self._in_flight[tp]) if self._in_flight.get(tp) else nxt
                    for tp, nxt in self._next.items()}

    def mark_committed(self, positions: dict[TP, int]) -> None:
        with self._lock:
            for tp, offset in positions.items():
                if tp in self._next:
                    self._committed[tp] = offset
                    if tp in self._telling:
                        self._told[tp] = self._telling[tp]

    def forget(self, tps: list[TP]) -> None:
        """Drop partitions this worker no longer owns."""
        with self._lock:
            for tp in tps:
                self._in_flight.pop(tp, None)
                self._waiting.pop(tp, None)
                self._next.pop(tp, None)
                self._committed.pop(tp, None)
                self._told.pop(tp, None)
                self._telling.pop(tp, None)
