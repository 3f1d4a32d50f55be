"""Retrying what depends on another service: exponential backoff, and logs that say
so once per interval instead of once per attempt."""

from __future__ import annotations

import logging
import random
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
    """Logs a recurring failure at most once per ``every_s``, with how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last = -float("inf")
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like this in the last {self.every_s:.0f} s)"
        self.logger.warning(message, *args)
        self._last, self._held = now, 0
