"""A worker's intake: prompts taken from the log, one partition's after another's never.

Taking a prompt can wait: for its conversation's key (a fetch from ``chat.keys``), or for
its partition's ledger (a read of the log). Taken one at a time in the worker's loop, one
prompt that waited held every partition's prompts, the control events (a cancel, a
client leaving) and the worker's heartbeat behind it. Here each prompt partition has a
lane of its own: a queue and a task that takes its records in order (a partition's
prompts are judged in the order the log holds them), while the loop goes on polling,
applying control events and beating. A record whose taking passes ``timeout_s`` is
handed to ``stalled`` (the worker dead-letters it) and its lane goes on; one whose
taking raised is handed to ``failed`` (the worker stops: a lane never dies unseen).

A record may come with a look-up it waits for first (``put``'s ``ready``): the keys of
the prompts polled with it, read together (``Keyring.prefetch``), so that no lane looks
one of them up on its own meanwhile. Whatever that look-up ends with, the record is
taken after it: a key it did not bring is looked up by the record's own taking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from pipeline.codec import Codec, Position, sealed_key
from pipeline.kafka import Record
from pipeline.keystore import Keyring
from pipeline.topics import PROMPTS

log = logging.getLogger(__name__)
Take = Callable[[Record], Awaitable[None]]
Queued = tuple[Record, "asyncio.Future[object] | None"]


class Lane:
    """One partition's queue of records, and the task that takes them."""

    def __init__(self, run: Callable[[asyncio.Queue[Queued]], Awaitable[None]]) -> None:
        self.queue: asyncio.Queue[Queued] = asyncio.Queue()
        self.task = asyncio.ensure_future(run(self.queue))


class Intake:
    """``take(record)`` takes one prompt record; ``stalled(record)`` is given one whose
    taking passed ``timeout_s``; ``failed(exc)`` an error no record should raise."""

    def __init__(self, take: Take, stalled: Take, failed: Callable[[BaseException], None],
                 timeout_s: float, keyring: Keyring | None = None) -> None:
        self._take, self._stalled, self._failed = take, stalled, failed
        self.timeout_s = timeout_s
        self._lanes: dict[int, Lane] = {}
        self._keyring = keyring  # the one behind the worker's codec, if any

    def keys_ahead(self, polled: list[Record], model: str
                   ) -> dict[Position, asyncio.Future[object]]:
        """The keys of the polled prompts' new conversations (of ``model``'s prompts: the
        others are not opened here), read together on a thread
        (``Keyring.prefetch``: one fetch and one look at the erasures' end, where each
        prompt's lane would make one of each), and what each of those prompts waits for
        before it is taken (``put``'s ``ready``); a prompt whose key is held waits for
        nothing. Nothing if fewer than two keys are not held."""
        keyring = self._keyring
        if keyring is None:
            return {}
        wanted: set[str] = set()
        waiting: list[Position] = []
        for record in polled:
            named = sealed_key(record.value, model) if record.position.topic == PROMPTS \
                else None
            if named is not None and not keyring.holds(named[0]):
                wanted.add(named[0])
                waiting.append(record.position)
        if len(wanted) < 2:
            return {}
        ahead: asyncio.Future[object] = asyncio.ensure_future(
            asyncio.to_thread(keyring.prefetch, wanted))
        # What it raised is the lanes' own look-ups' to say (Kafka away, say): retrieved.
        ahead.add_done_callback(lambda done: done.cancelled() or done.exception())
        return dict.fromkeys(waiting, ahead)

    def put(self, record: Record, ready: asyncio.Future[object] | None = None) -> None:
        """Queue ``record`` in its partition's lane, to be taken once ``ready`` (if any)
        is done (see the module)."""
        partition = record.position.partition
        lane = self._lanes.get(partition)
        if lane is None:
            lane = self._lanes[partition] = Lane(self._run)
        lane.queue.put_nowait((record, ready))

    async def _run(self, queue: asyncio.Queue[Queued]) -> None:
        """A lane's task: its records taken in order."""
        while True:
            record, ready = await queue.get()
            try:
                async with asyncio.timeout(self.timeout_s):
                    if ready is not None:  # shared by the lanes: waited for, never cancelled
                        await asyncio.wait([ready])
                    await self._take(record)
            except TimeoutError:
                await self._stalled(record)
            except Exception as exc:
                log.exception("taking %s failed", record.position)
                self._failed(exc)
                return
            finally:
                queue.task_done()

    def __len__(self) -> int:
        """Records put and not yet taken, in every lane."""
        return sum(lane.queue.qsize() for lane in self._lanes.values())

    async def drop(self, partitions: Iterable[int]) -> None:
        """Stop the lanes of ``partitions``: what they hold is left to the partitions'
        next reader (a record being taken is stopped where it is)."""
        lanes = [lane for p in list(partitions) if (lane := self._lanes.pop(p, None))]
        for lane in lanes:
            lane.task.cancel()
        for lane in lanes:
            with contextlib.suppress(asyncio.CancelledError):
                await lane.task

    async def close(self) -> None:
        await self.drop(list(self._lanes))


def keyring_of(codec: Codec) -> Keyring | None:
    """The keyring behind ``codec``, if one is (a worker's tests may give it another)."""
    return next((ring for ring in codec.cipher.rings if isinstance(ring, Keyring)), None)
