"""How far this host's clock is from its brokers', read off the writes it makes.

Most pipeline topics are stamped by their brokers (``LogAppendTime``,
``pipeline.topics``), so a record delivered there has the broker's time, taken a
moment before this host heard of it. A prompt still says when its gateway took it, and
a turn's records carry its worker's time, and readers look ``CLOCK_SKEW_MS`` before a
turn's prompt for them: hosts further apart than that would have a stream of a turn
begin after its first records. So each writer measures, and says so past half of it;
a worker also times a client's grace in the brokers' time (``workers.flights``).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Message

from pipeline.topics import CLOCK_SKEW_MS

log = logging.getLogger(__name__)

# Measured at most this often: a delivery costs a clock read, not a log line.
EVERY_S = 1.0
# A clock this far off is said, at most once a SAID_EVERY_S.
OFF_S = CLOCK_SKEW_MS / 2000
SAID_EVERY_S = 600.0


class BrokerClock:
    """The broker's clock less this host's, in seconds, at the last write measured (a
    delivery's latency makes it read up to that much behind)."""

    def __init__(self) -> None:
        self.ahead_s = 0.0
        self._measured = -EVERY_S
        self._said = -SAID_EVERY_S

    def observe(self, msg: Message) -> None:
        """Measure on a delivered record's time, if its broker stamped it."""
        now = time.monotonic()
        if now - self._measured < EVERY_S:
            return
        kind, stamped_ms = msg.timestamp()
        if kind != TIMESTAMP_LOG_APPEND_TIME:
            return
        self._measured = now
        self.ahead_s = stamped_ms / 1000 - time.time()
        if abs(self.ahead_s) > OFF_S and now - self._said >= SAID_EVERY_S:
            self._said = now
            log.warning(
                "this host's clock is %.0f s %s the Kafka brokers': keep it within %.0f s "
                "(NTP), or streams resumed from a turn's start may miss its first tokens",
                abs(self.ahead_s), "behind" if self.ahead_s > 0 else "ahead of",
                CLOCK_SKEW_MS / 1000)
