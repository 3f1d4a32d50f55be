"""Retrying what depends on another service: exponential backoff, and logs that say
so once per interval instead of once per attempt."""

from __future__ import annotations

import logging
import random
import re
import time


class Backoff:
    """Delays that double from ``first_s`` up to ``max_s``, with jitter; ``reset`` after
    a success."""

    def __init__(self, first_s: float = 0.2, max_s: float = 10.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s
        self.failures = 0

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.max_s)
        self.failures += 1
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.first_s
        self.failures = 0


class QuietLog:
    """Logs each recurring failure (by its message template) at most once per
    ``every_s``, with how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        last, held = self._last.get(message, (-float("inf"), 0))
        if now - last < self.every_s:
            self._last[message] = (last, held + 1)
            return
        self._last[message] = (now, 0)
        suffix = f" ({held} more like this in the last {self.every_s:.0f} s)" if held else ""
        self.logger.warning(message + suffix, *args)


class RepeatFilter(logging.Filter):
    """Lets a log record through at most once per ``every_s`` for each shape of message
    (its text with numbers blanked: one broker's "connection refused" is one shape, at
    whatever time and port), and says how many were held back in between."""

    _NUMBERS = re.compile(r"\d+")

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, self._NUMBERS.sub("#", record.getMessage()))
        now = time.monotonic()
        last, held = self._seen.get(key, (-float("inf"), 0))
        if now - last < self.every_s:
            self._seen[key] = (last, held + 1)
            return False
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {self.every_s:.0f} s)"
        return True
