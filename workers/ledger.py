"""The verdicts on a worker's prompt partitions: which prompt of a session runs, which is
void (a racing turn came first) and which is a duplicate (``schemas.conversation``).

Each partition's ledger is complete from an offset on (``known_from``): from the committed
offset at assignment. A prompt whose session's history reaches further back has the
ledger read the prompts before that first, back as far as their own verdicts need.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pipeline.codec import parse_or_none
from pipeline.kafka import KafkaException, Record, read_spans
from pipeline.retry import Backoff
from pipeline.topics import PROMPTS
from schemas import PromptSubmitted
from schemas.conversation import TurnLedger, Verdict

log = logging.getLogger(__name__)
# A partition's ledger keeps this many prompts back; a prompt whose history was read
# further back than that has the ledger read the log again.
LEDGER_SPAN = 50_000


@dataclass
class _Ledger:
    """A partition's prompt verdicts, complete for offsets from ``known_from`` on."""

    known_from: int
    ledger: TurnLedger = field(default_factory=TurnLedger)


class Ledgers:
    """The ledgers of the prompt partitions this worker owns."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._by_partition: dict[int, _Ledger] = {}

    def __len__(self) -> int:
        return len(self._by_partition)

    @property
    def partitions(self) -> list[int]:
        return list(self._by_partition)

    def assign(self, committed: dict[int, int]) -> None:
        """Start afresh on these partitions, each known from its committed offset."""
        self._by_partition = {p: _Ledger(known_from=o) for p, o in committed.items()}

    def drop(self, partitions: list[int]) -> None:
        for p in partitions:
            self._by_partition.pop(p, None)

    async def judge(self, prompt: PromptSubmitted, partition: int,
                    offset: int) -> Verdict | None:
        """The prompt's verdict (None: the partition is no longer this worker's)."""
        state = self._by_partition.get(partition)
        if state is None:
            return None
        end = prompt.history_end
        if end is not None and end < state.known_from:
            await self._extend(state, partition, end)
        if offset - state.known_from > 2 * LEDGER_SPAN:  # keep the ledger bounded
            state.known_from = offset - LEDGER_SPAN
            state.ledger.forget_before(state.known_from)
        return state.ledger.decide(prompt.conversation_id, prompt.request_id, end,
                                   offset).verdict

    async def _extend(self, state: _Ledger, partition: int, start: int) -> None:
        """Make the ledger know the prompts from ``start`` on: read what lies before its
        known part, back as far as those prompts' own verdicts need."""
        target = start
        while True:
            records = await self._read_prompts(partition, target, state.known_from)
            prompts = [(r.position.offset, e) for r in records
                       if isinstance(e := parse_or_none(r.value),
                                                 PromptSubmitted)]
            needed = min((p.history_end for _, p in prompts
                          if p.history_end is not None and p.history_end < target), default=None)
            if needed is None:
                break
            target = needed
        for offset, prompt in prompts:
            state.ledger.decide(prompt.conversation_id, prompt.request_id, prompt.history_end,
                                offset)
        state.known_from = target

    async def _read_prompts(self, partition: int, start: int, end: int) -> list[Record]:
        """The prompts in ``[start, end)``; the verdicts wait for them, so retry until read."""
        backoff = Backoff()
        while True:
            try:
                return await asyncio.to_thread(read_spans, self.bootstrap, PROMPTS,
                                               {partition: (start, end)})
            except (KafkaException, TimeoutError) as exc:
                delay = backoff.next()
                log.warning("could not read prompts %d-%d of partition %d (retrying in "
                            "%.1f s): %s", start, end, partition, delay, exc)
                await asyncio.sleep(delay)
