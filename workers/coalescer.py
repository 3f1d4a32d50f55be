"""Gathering a turn's tokens into ``TokenDelta`` payloads. No I/O.

The first tokens go at once (time to first token). Later ones are held and go out
together when a token arrives in a later window of ``window_s``. The windows are
aligned to the clock, not timed from each turn's last delta, so the turns of one
engine step emit their deltas together and the producer packs them into one request:
Kafka requests per second stay near 1 / ``window_s`` whatever the concurrency. (Timers
per turn spread them out instead: one request per delta.) ``window_s`` 0 emits one
delta per engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Coalescer:
    window_s: float
    emitted: int = 0  # deltas of this turn already out (earlier attempts' included)
    _text: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _window: int | None = None

    def add(self, text: str, token_ids: tuple[int, ...],
            now: float) -> tuple[str, tuple[int, ...]] | None:
        """Take one engine step's output; the delta to emit now, if any."""
        if not text and not token_ids:
            return None
        window = int(now / self.window_s) if self.window_s else None
        if self.emitted and window is not None and window == self._window:
            self._text.append(text)
            self._ids.extend(token_ids)
            return None
        self._window = window
        if not self._text:  # nothing held: this output is the delta, as it came
            self.emitted += 1
            return text, token_ids
        self._text.append(text)
        self._ids.extend(token_ids)
        return self.drain()

    def drain(self) -> tuple[str, tuple[int, ...]] | None:
        """Whatever is held, as one delta (None if nothing is)."""
        if not self._text and not self._ids:
            return None
        delta = "".join(self._text), tuple(self._ids)
        self._text.clear()
        self._ids.clear()
        self.emitted += 1
        return delta
