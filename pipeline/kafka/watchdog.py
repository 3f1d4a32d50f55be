"""A ``TransactionalProducer``'s watchdog (``Watchdog``): a thread that answers
``NotAccepted`` for records past their deadline that are certain never to be written,
and replaces a transaction that is stuck, not slow (see ``TransactionalProducer``)."""

from __future__ import annotations

import threading
import time
from typing import Protocol

from pipeline.kafka.outbox import NotAccepted, Outbox, Queued, settle

# How often it looks: a late record is answered within this of its deadline.
PERIOD_S = 0.05


class Watched(Protocol):
    """What the watchdog needs of the transaction loop."""

    def replace_if_stuck(self) -> None: ...

    def doom_late(self, now: float) -> list[Queued]: ...


class Watchdog:
    def __init__(self, outbox: Outbox, transactions: Watched) -> None:
        self._outbox = outbox
        self._transactions = transactions
        self._thread = threading.Thread(target=self._run, name="kafka-deadlines", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        """Late records: queued ones (in no transaction), and those of an open
        transaction that has not asked to commit, which is then doomed to abort."""
        outbox = self._outbox
        while True:
            self._transactions.replace_if_stuck()
            with outbox.cond:
                if outbox.drained:
                    return
                now = time.monotonic()
                late = outbox.take_late(now) + self._transactions.doom_late(now)
                for item in late:
                    settle(item, NotAccepted("the log did not take it in time"))
            time.sleep(PERIOD_S)
