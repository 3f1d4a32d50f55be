"""Reading and writing ``chat.rollouts`` (one partition, compacted, kept forever): the
``Rollout`` records (``schemas.rollout``) gateways route by and ``pipeline rollout``
writes. Nothing else holds routing state, so any number of gateways agree.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError

from pipeline.codec import summarise
from pipeline.kafka import ProduceError
from pipeline.kafka.plain import BEGINNING, PlainReader, PlainWriter
from pipeline.retry import QuietLog
from pipeline.topics import ROLLOUTS
from schemas.rollout import Rollout, stale

log = logging.getLogger(__name__)


class RolloutBook:
    """The latest record per alias, read from ``chat.rollouts``. ``refresh()`` reads
    what arrived (call it from one thread)."""

    def __init__(self, bootstrap: str) -> None:
        self._reader = PlainReader(bootstrap, "rollouts")
        self._reader.start({(ROLLOUTS, 0): BEGINNING})
        self.latest: dict[str, Rollout] = {}
        self.history: list[Rollout] = []
        self.unreadable = 0  # records that are not rollouts, passed over
        self._quiet = QuietLog(log)

    def refresh(self) -> dict[str, Rollout]:
        for msg in self._reader.read(1000):
            if msg.value is None:
                continue
            try:
                record = Rollout.model_validate_json(msg.value)
            except ValidationError as exc:
                self.unreadable += 1
                self._quiet.warning("%s holds records that are not rollouts (%d so far; "
                                    "at offset %s: %s)", ROLLOUTS, self.unreadable,
                                    msg.position.offset, summarise(exc))
                continue
            if stale(self.latest.get(record.alias), record):
                continue
            self.latest[record.alias] = record
            self.history.append(record)
        return dict(self.latest)

    def read_to_end(self, timeout: float = 10.0) -> dict[str, Rollout]:
        """Everything written so far (for a command, not a request path)."""
        high = self._reader.end(ROLLOUTS, 0, timeout)
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            position = self._reader.position(ROLLOUTS, 0)
            if position >= high or (high == 0):
                return dict(self.latest)
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {ROLLOUTS} to its end")
            time.sleep(0.05)

    def close(self) -> None:
        self._reader.close()


def publish(bootstrap: str, record: Rollout, timeout: float = 30.0) -> None:
    """Write ``record``; return once it is durable, or raise."""
    writer = PlainWriter(bootstrap, "rollout-writer")
    writer.send(ROLLOUTS, record.alias.encode(), record.model_dump_json().encode())
    failed = writer.flush(timeout)
    if failed:
        raise ProduceError(f"rollout record not acknowledged: {failed[0]}")


