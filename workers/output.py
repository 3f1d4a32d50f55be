"""What a worker's turns write: their text to the live stream, many turns to a record,
and their starts and ends to the durable record, in the same transaction.

Each partition has one open ``LiveBatch`` (``schemas.live``), which the turns running
there add their entries to. ``flush`` (once the turns an engine step woke have run)
seals every open batch and queues it with the durable events that go with its entries,
together (``TransactionalProducer.send_together``): one transaction holds a turn's last
delta, its end entry and its ``GenerationFinished``, so a reader never sees a turn end
in one without the other, and a replaced worker's records are fenced together.

A batch is also sealed when its text passes ``max_bytes`` (a record the topic takes).

Each turn's text in a batch is sealed with its conversation's data key, one box per
turn per record (``schemas.live``, ``pipeline.sealing``): looked up when the record is
made, so a turn whose keys are destroyed while it runs writes no more text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from pipeline import sealing
from pipeline.codec import Codec, Position, SealWith
from pipeline.deadletter import dead_letter_headers
from pipeline.kafka import Fenced, Outgoing, Record, TransactionalProducer
from pipeline.topics import DEADLETTER, GENERATIONS, LIVE, WORKERS_GROUP
from schemas import Event, GenerationFailed, GenerationFinished, GenerationStarted
from schemas.live import LiveDelta, LiveEnd, LiveFailure, LiveStart, write_batch

# The passes of the event loop after a turn's write that its gather waits
# (``Output.gather_soon``): then what it wrote is queued, once the writer can take it.
GATHER_PASSES = 2
# The longest a gather holds the open batches for the transaction being made to end: a
# bound in case its end is never told (the writer failed for good, say).
HOLD_MAX_S = 1.0
# What an entry costs in a batch besides its text (its reference, seq and brackets).
ENTRY_BYTES = 48
_encoder = msgspec.json.Encoder()


class Lane(Protocol):
    """A running turn whose text is held for its partition's open record (``hold``),
    until the record is made and takes it as one delta."""

    ref: int  # the turn's prompt's offset
    batch: object  # the open record it is held for: ``Output.hold`` sets it

    def drain(self) -> tuple[int, str, tuple[int, ...]] | None:
        """What it holds as its next delta (seq, text, token ids), or None."""
        ...


@dataclass
class _Open:
    """One partition's batch being built, and what waits for it."""

    starts: list[LiveStart] = field(default_factory=list)
    deltas: list[LiveDelta] = field(default_factory=list)
    ends: list[LiveEnd] = field(default_factory=list)
    failures: list[LiveFailure] = field(default_factory=list)
    durable: list[tuple[bytes, bytes, asyncio.Future[Position] | None]] = field(
        default_factory=list)
    # The text and token ids of each sealed turn's deltas, in order, by ref: its deltas
    # above hold them empty (``schemas.live``); one box each when the batch is sealed.
    texts: dict[int, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    # The turns holding text for this record, in the order they first held some.
    lanes: list[Lane] = field(default_factory=list)
    size: int = 0

    def __bool__(self) -> bool:
        return bool(self.starts or self.deltas or self.ends or self.failures or self.durable
                    or self.lanes)


class Output:
    def __init__(self, writer: TransactionalProducer, worker: str, codec: Codec) -> None:
        self.writer = writer
        self.worker = worker
        self.codec = codec  # seals a turn's records with its conversation's key
        self._open: dict[int, _Open] = {}
        self._gathering = False  # a gather is scheduled or holding
        # While a gather holds: what releases it (its bound, or the spacing's end).
        self._holding: asyncio.TimerHandle | None = None
        self.records = 0  # live records written (queued)
        # A batch is sealed past this: half the largest record the topic takes.
        self.max_bytes = writer.limit(LIVE) // 2
        # Each running turn's conversation, and what its text is sealed with, by
        # (partition, ref): the key its prompt was opened with.
        self._seals: dict[tuple[int, int], tuple[uuid.UUID, SealWith]] = {}
        self._sealing = bool(codec.cipher)  # else every turn's text goes in the clear

    def _batch(self, partition: int) -> _Open:
        batch = self._open.get(partition)
        if batch is None:
            batch = self._open[partition] = _Open()
        return batch

    def start(self, partition: int, ref: int, started: GenerationStarted, key: bytes,
              epoch: int, seal: SealWith) -> None:
        """Add the turn's start; its text is sealed with ``seal`` (see ``SealWith``)."""
        batch = self._batch(partition)
        batch.starts.append((ref, started.attempt, started.request_id))
        self._seals[(partition, ref)] = (started.conversation_id, seal)
        batch.durable.append((key, self.encoded(started, seal), None))
        self._grown(partition, batch, ENTRY_BYTES + len(started.request_id), epoch)

    def encoded(self, event: Event, seal: SealWith) -> bytes:
        """A turn's durable event as its record, sealed with ``seal`` (dropped if its
        conversation's keys were destroyed meanwhile)."""
        return self.codec.encode(event, seal)

    def hold(self, partition: int, lane: Lane, added: int, epoch: int) -> None:
        """``lane`` holds ``added`` more bytes of text for ``partition``'s open record
        (the engine's step loop calls this per sequence per step: it does no more than
        note it): the record takes it as one delta when it is made."""
        batch = self._open.get(partition)
        if batch is None:
            batch = self._open[partition] = _Open()
        if lane.batch is not batch:
            lane.batch = batch
            batch.lanes.append(lane)
            added += ENTRY_BYTES
            self.gather_soon()
        batch.size += added
        if batch.size > self.max_bytes:
            self._seal(partition, epoch)

    def delta(self, partition: int, ref: int, seq: int, text: str,
              token_ids: tuple[int, ...], epoch: int) -> None:
        """Add one of the turn's deltas: its text held for the turn's box if the turn is
        sealed."""
        batch = self._batch(partition)
        self._add_delta(partition, batch, ref, seq, text, token_ids)
        self._grown(partition, batch, ENTRY_BYTES + 4 * len(text) + 8 * len(token_ids), epoch)

    def _add_delta(self, partition: int, batch: _Open, ref: int, seq: int, text: str,
                   token_ids: tuple[int, ...]) -> None:
        sealing_with = self._seals.get((partition, ref)) if self._sealing else None
        if sealing_with is None or sealing_with[1] is None:
            batch.deltas.append((ref, seq, text, token_ids))
        else:
            batch.deltas.append((ref, seq, "", ()))
            held = batch.texts.get(ref)
            if held is None:
                batch.texts[ref] = [(text, token_ids)]
            else:
                held.append((text, token_ids))

    def end(self, partition: int, ref: int, final: GenerationFinished | GenerationFailed,
            key: bytes, value: bytes) -> asyncio.Future[Position]:
        """Add the turn's end, ``value`` its durable event as encoded (and sealed) for the
        log; the future resolves once its transaction committed (or fails as ``send``
        would: ``Fenced``, ``RecordTooLarge``...)."""
        batch = self._batch(partition)
        if isinstance(final, GenerationFinished):
            batch.ends.append((ref, final.deltas, final.finish_reason,
                               final.usage.prompt_tokens, final.usage.completion_tokens))
        else:
            batch.failures.append((ref, final.code, final.message))
        answer: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        batch.durable.append((key, value, answer))
        return answer

    def _grown(self, partition: int, batch: _Open, added: int, epoch: int) -> None:
        batch.size += added
        if batch.size > self.max_bytes:
            self._seal(partition, epoch)

    def gather_soon(self) -> None:
        """Once the turns the event loop has ready have run, queue what they wrote (one
        live record per partition) and tell the writer it is all queued: an engine
        step's outputs wake its turns together, so the step's deltas share one record per
        partition and one transaction (see ``TransactionalProducer``).

        A step that ends turns also wakes their tasks (the engine resolves each one's
        run), which write their ends in the loop's next pass, after a gather scheduled
        by the step's first delta: the gather waits that one pass more
        (``GATHER_PASSES``), so the ends join their step's deltas in one record per
        partition and one transaction, not a transaction of their own after it.

        The gather then holds the batches open while the writer could not take them yet
        (a transaction being made, or the spacing since the last not passed): they would
        wait as long in its queue, and the next steps' entries join the same records, so
        a transaction holds one live record per partition and one box per turn however
        many steps it spans (an engine faster than the transactions: a GPU's 10 ms
        steps against their 20 ms floor)."""
        if not self._gathering:
            self._gathering = True
            asyncio.get_running_loop().call_soon(self._gather, GATHER_PASSES - 1)

    def _gather(self, passes_left: int) -> None:
        if passes_left:
            asyncio.get_running_loop().call_soon(self._gather, passes_left - 1)
            return
        self._hold()

    def _hold(self) -> None:
        """Release the open batches now if the writer can take them, else once it can: when
        the transaction being made is over (bounded by ``HOLD_MAX_S``), then once the
        spacing since it began has passed."""
        if self._holding is not None:
            self._holding.cancel()
            self._holding = None
        loop = asyncio.get_running_loop()
        wait = self.writer.begins_in()
        if wait is None and self.writer.when_free(self._freed):
            self._holding = loop.call_later(HOLD_MAX_S, self._release)
        elif wait:
            self._holding = loop.call_later(wait, self._release)
        else:
            self._release()

    def _freed(self) -> None:
        if self._holding is not None:  # else released already (by the bound, say)
            self._hold()

    def _release(self) -> None:
        """Queue the open batches, and tell the writer they are all queued."""
        if self._holding is not None:
            self._holding.cancel()
            self._holding = None
        self._gathering = False
        self.flush(self.writer.epoch)
        self.writer.gathered()

    async def dead_letter(self, record: Record, reason: str) -> None:
        """Park a record no one can read, in this worker's transactions: a worker that
        lost the record's partition is fenced, and the next owner parks it."""
        try:
            await self.writer.send_raw(DEADLETTER, record.key, record.value,
                                       dead_letter_headers(record, reason, WORKERS_GROUP),
                                       self.writer.epoch)
        except Fenced:
            pass

    def flush(self, epoch: int) -> None:
        """Queue every open batch (see the module)."""
        for partition in list(self._open):
            self._seal(partition, epoch)

    def _seal(self, partition: int, epoch: int) -> None:
        batch = self._open.pop(partition, None)
        if not batch:
            return
        for lane in batch.lanes:  # what its turns hold: a delta each
            drained = lane.drain()
            if drained is not None:
                self._add_delta(partition, batch, lane.ref, *drained)
        records = []
        if batch.starts or batch.deltas or batch.ends or batch.failures:
            value = write_batch(self.worker, int(time.time() * 1000), batch.starts,
                                batch.deltas, batch.ends, batch.failures,
                                self._sealed(partition, batch.texts))
            records.append(Outgoing(LIVE, None, value, partition))
            self.records += 1
            for ref in [e[0] for e in batch.ends] + [f[0] for f in batch.failures]:
                self._seals.pop((partition, ref), None)
        records += [Outgoing(GENERATIONS, key, value, answer=answer is not None)
                    for key, value, answer in batch.durable]
        if not records:  # its turns' text was all taken at their ends, or dropped
            return
        futures = self.writer.send_together(records, epoch)
        answers = [answer for _, _, answer in batch.durable]
        for mine, theirs in zip(answers, futures[len(futures) - len(answers):], strict=True):
            if mine is not None and theirs is not None:
                _chain(theirs, mine)

    def _sealed(self, partition: int, texts: dict[int, list[tuple[str, tuple[int, ...]]]]
                ) -> list[tuple[int, str, str]]:
        """The boxes of a batch's sealed turns, one per turn (``schemas.live``): its
        deltas' text and token ids sealed with its key, or none if its conversation's
        keys were destroyed meanwhile."""
        cipher = self.codec.cipher
        sealed = []
        for ref, group in texts.items():
            conversation, key = self._seals.get((partition, ref), (None, None))
            if isinstance(key, sealing.DataKey) and not (
                    conversation is not None and cipher.revoked(conversation)):
                sealed.append((ref, key.key_id, sealing.seal(key, _encoder.encode(group))))
            else:  # its keys were destroyed: its text is not written
                sealed.append((ref, sealing.ERASED, ""))
        return sealed

    def drop(self, partitions: list[int] | None = None) -> None:
        """Forget the open batches (of ``partitions``, or all): their turns were given up."""
        for partition in list(self._open) if partitions is None else partitions:
            batch = self._open.pop(partition, None)
            for _, _, answer in batch.durable if batch else ():
                if answer is not None:  # its turn's task was stopped before this
                    answer.cancel()
        self._seals = {at: c for at, c in self._seals.items()
                       if partitions is not None and at[0] not in partitions}


def _chain(source: asyncio.Future[Position], target: asyncio.Future[Position]) -> None:
    def copy(done: asyncio.Future[Position]) -> None:
        error = None if done.cancelled() else done.exception()  # retrieved, whoever waits
        if target.done():
            return
        if done.cancelled():
            target.cancel()
        elif error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
