"""One fan-out per gateway process: a single consumer tails ``chat.generations`` and
routes each event to the queue of the request waiting for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

from pipeline.codec import DecodeError, Position, decode
from pipeline.kafka import AsyncConsumer
from pipeline.topics import GENERATIONS
from schemas import GenerationEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivered:
    position: Position
    event: GenerationEvent


class GenerationTail:
    def __init__(self, bootstrap: str) -> None:
        # Partitions are assigned, not subscribed: every gateway reads every partition,
        # and the group id is only a label (nothing is committed).
        self._consumer = AsyncConsumer(bootstrap, f"gateway-tail-{uuid.uuid4().hex[:12]}")
        self._queues: dict[str, asyncio.Queue[Delivered]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ends = await self._consumer.call(self._consumer.assign_at_end_sync, GENERATIONS)
        log.info("tailing %s from %s", GENERATIONS, ends)
        self._task = asyncio.create_task(self._run(), name="generation-tail")

    async def _run(self) -> None:
        while True:
            try:
                records = await self._consumer.poll_batch(1000, 0.05)
            except Exception:
                log.exception("generation tail poll failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for record in records:
                try:
                    event = decode(record.value)
                except DecodeError:
                    continue  # the projector dead-letters it
                queue = self._queues.get(event.request_id)
                if queue is not None and isinstance(event, GenerationEvent):
                    queue.put_nowait(Delivered(record.position, event))

    def subscribe(self, request_id: str) -> asyncio.Queue[Delivered]:
        queue: asyncio.Queue[Delivered] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.close()
