"""One fan-out per gateway process: a single consumer tails the live stream
(``chat.live``) and routes each turn's entries to the subscriptions of the requests
waiting for it.

* Partitions are read on demand: a partition is added (at its current end, a concrete
  offset, so nothing produced afterwards is missed) when a request in it is followed,
  and dropped after ``linger_s`` without one. Records of a partition still tailed but
  with nothing followed in it are passed over unparsed.
* A live record holds many turns' entries (``schemas.live``). Entries name their turn
  by its reference (its prompt's offset); a turn's start entry names its request id
  too. A subscription knows its turn's reference when it attaches to a turn the log
  has, or learns it from the turn's start entry when it follows a new turn.
* The same partition of ``chat.generations`` is read beside it, for turns written
  before the live stream (their ``TokenDelta`` events are there): filtered by key
  (conversation) before decoding, and only events without a reference (v1) count.
* A turn may end with no start entry (a worker refused it before its first token),
  and a gateway learns a new turn's reference only once its prompt's write is
  answered. So while a partition has a subscription that does not know its reference
  yet, the ends of turns nobody here follows are held (``HOLD_S``, at most
  ``HOLD_MAX``) and handed over when a subscription learns it: no turn's end is read
  before its follower could claim it and passed over.
* A subscription gets the records from its ``starts`` on, none before: a client that
  attaches to a running turn reads it from the log up to there, then live, with no
  record in both. No entry of a followed turn goes out with its text still sealed, even
  when the turn was followed while a key was read for its record.
* Each subscription is bounded (``gateway.subscription``): a slow client never stalls
  others.
* Timing is swept, not timed per event: once a second the fan-out wakes readers that
  have had nothing for ``KEEPALIVE_S`` (a keep-alive is due) or whose deadline passed,
  so a delta costs its reader no timer.
* A tailed partition that has records to read and has read none for ``STALL_S`` is
  read again from where it stopped (``_check_stalls``): librdkafka's fetcher for an
  assigned partition can stop for good once its brokers restart (librdkafka #5153,
  #4492; seen here once after the whole cluster was lost twice), and every stream on
  it would then wait until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable

from gateway.dependencies import from_log
from gateway.subscription import Delivered, Subscription, legacy, release
from pipeline.codec import TP, Codec, DecodeError, parse_live
from pipeline.kafka import QUICK_ASSIGN, LogReader, Record
from pipeline.retry import QuietLog
from pipeline.topics import GENERATIONS, LIVE
from schemas import GenerationEvent
from schemas.live import TERMINAL, Start, entries

log = logging.getLogger(__name__)
# A reader that has had nothing for this long is woken to send a keep-alive (proxies
# close connections that stay silent), or to give up once its deadline has passed.
KEEPALIVE_S = 15.0
SWEEP_S = 1.0
# A tailed partition whose position has not moved for this long while its end is past
# it is read again from there (a fetcher that stopped); an idle one costs a position
# look-up every ``STALL_S`` / 2 and an end asked of Kafka every ``STALL_S``.
STALL_S = 10.0
TAILED = (LIVE, GENERATIONS)
# How long the end of a turn nobody here follows is held while its partition has a
# subscription that does not know its reference yet, and how many are held at most.
HOLD_S = 30.0
HOLD_MAX = 10_000


class GenerationTail:
    def __init__(
        self, bootstrap: str, codec: Codec,
        ends_of: Callable[[list[TP]], Awaitable[dict[TP, int]]],
        linger_s: float = 60.0, max_items: int = 1000, max_bytes: int = 4_000_000,
        timeout_s: float = 5.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._codec = codec  # opens the text of the turns followed here
        self._quiet = QuietLog(log)
        # Partitions are assigned, not subscribed: the group id is only a label.
        self._consumer = LogReader(bootstrap, f"gateway-tail-{uuid.uuid4().hex[:12]}", "tail",
                                   **QUICK_ASSIGN)
        self._ends_of = ends_of
        self._linger_s = linger_s
        self._limits = (max_items, max_bytes)
        self._subs: dict[str, set[Subscription]] = {}
        self._refs: dict[tuple[int, int], str] = {}  # (partition, ref) -> request id
        self._ref_of: dict[str, tuple[int, int]] = {}  # and back
        self._keys: Counter[bytes] = Counter()
        self._next: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset
        self._users: Counter[int] = Counter()
        self._unbound: Counter[int] = Counter()  # per partition: subscriptions with no ref
        # (partition, ref) -> (when read, the end, its record's time) of turns that no
        # subscription here knows (``_hold``)
        self._held: dict[tuple[int, int], tuple[float, Delivered, int]] = {}
        self._idle_since: dict[int, float] = {}
        self._adding = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.undecodable = 0  # live records that did not decode (passed over)
        # Per tailed partition: its position when last seen to move, and since when.
        self._moved: dict[tuple[str, int], tuple[int, float]] = {}
        self._last_check = time.monotonic()
        self.rereads = 0  # partitions read again because they stopped (``_check_stalls``)

    @property
    def partitions(self) -> list[int]:
        return sorted({p for topic, p in self._next if topic == LIVE})

    async def start(self) -> None:
        for topic in TAILED:  # metadata, so a first follow waits for no lookup
            await self._consumer.partitions(topic)
        self._task = asyncio.create_task(self._run(), name="generation-tail")

    async def follow(self, request_id: str, key: bytes, partition: int,
                     ref: int | None = None, held: bool = False) -> Subscription:
        """Subscribe to a turn's items from the current end of its partition on; ``ref``:
        its reference, if known (else its start entry tells it); ``held``: its reader
        reads the turn from the log first, and says what it has (``hand_off``)."""
        await self._ensure(partition)
        known = self._ref_of.get(request_id)
        if ref is None and known is not None and known[0] == partition:
            ref = known[1]  # another follower here learned it already
        sub = Subscription(request_id, key, partition,
                           {t: self._next[(t, partition)] for t in TAILED}, ref,
                           *self._limits, held=held)
        self._subs.setdefault(request_id, set()).add(sub)
        if ref is not None:
            self._bind(partition, ref, request_id)
        else:
            self._unbound[partition] += 1
        self._keys[key] += 1
        self._users[partition] += 1
        self._idle_since.pop(partition, None)
        return sub

    def unfollow(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.request_id)
        if subs is None or sub not in subs:
            return
        subs.discard(sub)
        if sub.ref is None:
            release(self._unbound, sub.partition)
        if not subs:
            del self._subs[sub.request_id]
            bound = self._ref_of.pop(sub.request_id, None)
            if bound is not None:
                self._refs.pop(bound, None)
        release(self._keys, sub.key)
        if release(self._users, sub.partition):
            self._idle_since[sub.partition] = time.monotonic()

    def bind(self, sub: Subscription, ref: int) -> None:
        """``sub``'s turn has reference ``ref`` (its prompt's offset)."""
        if sub.request_id in self._subs:
            self._bind(sub.partition, ref, sub.request_id)

    def _bind(self, partition: int, ref: int, request_id: str) -> None:
        self._refs[(partition, ref)] = request_id
        self._ref_of[request_id] = (partition, ref)
        subs = self._subs.get(request_id, ())
        for sub in subs:
            if sub.ref is None:
                release(self._unbound, sub.partition)
            sub.ref = ref
        held = self._held.pop((partition, ref), None)
        if held is not None:  # its end was read before anyone here knew its reference
            for sub in subs:
                self._deliver(sub, held[1], held[2])

    def _hold(self, partition: int, ref: int, delivered: Delivered, written_ms: int) -> None:
        """Keep the end of a turn nobody here knows, while ``partition`` has a
        subscription that may learn its reference (see the module)."""
        self._held.pop((partition, ref), None)  # kept in the order they were read
        self._held[(partition, ref)] = (time.monotonic(), delivered, written_ms)
        if len(self._held) > HOLD_MAX:
            del self._held[next(iter(self._held))]

    def _release_held(self) -> None:
        """Forget the ends held past ``HOLD_S``, and all of them once every subscription
        knows its reference."""
        if not self._unbound:
            self._held.clear()
            return
        expired = time.monotonic() - HOLD_S
        while self._held:
            key = next(iter(self._held))
            if self._held[key][0] > expired:
                break
            del self._held[key]

    async def _ensure(self, partition: int) -> None:
        if (LIVE, partition) in self._next:
            return
        async with self._adding:
            if (LIVE, partition) in self._next:
                return
            ends = await self._ends_of([(t, partition) for t in TAILED])
            self._next.update(ends)
            try:
                await from_log(
                    lambda: self._consumer.add_partitions(ends),
                    self._timeout_s)
            except BaseException:
                for tp in ends:
                    del self._next[tp]
                raise
            now = time.monotonic()
            self._moved.update({tp: (offset, now) for tp, offset in ends.items()})
        log.info("tailing partition %d of %s from %s", partition, " and ".join(TAILED),
                 " and ".join(str(o) for o in ends.values()))

    def _sweep(self) -> None:
        """Nudge the readers due a keep-alive, and those past their deadline."""
        now = time.monotonic()
        self._release_held()
        for subs in self._subs.values():
            for sub in subs:
                if now - sub.last_read >= KEEPALIVE_S or (
                        sub.deadline is not None and now >= sub.deadline):
                    sub.nudge()

    async def _drop_idle(self) -> None:
        now = time.monotonic()
        idle = [p for p, since in self._idle_since.items() if now - since > self._linger_s]
        for p in idle:
            del self._idle_since[p]
            for topic in TAILED:
                self._next.pop((topic, p), None)
                self._moved.pop((topic, p), None)
        if idle:
            await self._consumer.drop_partitions([(t, p) for p in idle for t in TAILED])
            log.info("stopped tailing partitions %s", idle)

    async def _check_stalls(self) -> None:
        """Read again each tailed partition whose position has not moved for ``STALL_S``
        while its end is past it (see the module). Its records from ``_next`` on are
        fetched anew: none routed already comes again."""
        now = time.monotonic()
        if now - self._last_check < STALL_S / 2:
            return
        self._last_check = now
        tailed = list(self._moved)
        positions = await self._consumer.positions(tailed) if tailed else {}
        for tp in tailed:
            if tp not in self._next:
                continue  # dropped meanwhile
            # No position yet (nothing read since it was assigned): where it was.
            position = positions.get(tp, self._next[tp])
            seen, since = self._moved[tp]
            if position != seen or now - since < STALL_S:
                if position != seen:
                    self._moved[tp] = (position, now)
                continue
            self._moved[tp] = (position, now)  # asked again in ``STALL_S`` at the soonest
            end = (await self._ends_of([tp]))[tp]
            if end <= position or tp not in self._next:
                continue  # idle: nothing to read
            start = self._next[tp]
            log.warning("partition %d of %s has had records to read for %.0f s and this "
                        "gateway read none: reading it again from %d (its end: %d)", tp[1],
                        tp[0], now - since, start, end)
            self.rereads += 1
            await from_log(functools.partial(self._consumer.add_partitions, {tp: start}),
                           self._timeout_s)

    async def _route(self, record: Record) -> None:
        pos = record.position
        tp = (pos.topic, pos.partition)
        if tp not in self._next:
            return  # dropped while this batch was in flight
        # Never back: a record fetched before its partition was dropped and added again
        # may come after; a subscription's ``starts`` is where the log was read up to.
        self._next[tp] = max(self._next[tp], pos.offset + 1)
        if pos.topic == LIVE:
            await self._route_live(record)
        elif record.key in self._keys:
            await self._route_legacy(record)

    async def _route_live(self, record: Record) -> None:
        partition = record.position.partition
        if partition not in self._users:
            return  # lingering: nothing is followed in its partition
        try:
            batch = parse_live(record.value)
            # The text of the turns followed here is opened, no other's. A turn followed
            # while a key was read for this is opened too, before any entry goes out:
            # no entry of a turn followed here goes out with its text sealed.
            tried: set[int] = set()
            while batch.sealed:
                followed = {ref for ref, *_ in batch.sealed if (partition, ref) in self._refs}
                followed |= {ref for ref, _, request_id in batch.starts
                             if request_id in self._subs}
                followed -= tried
                if not followed:
                    break
                tried |= followed
                batch = await self._codec.open_live_async(batch, followed)
        except DecodeError as exc:
            self.undecodable += 1
            self._quiet.warning("passing over %s, not a live batch: %s", record.position, exc)
            return
        for index, ref, item in entries(batch):
            request_id = self._refs.get((partition, ref))
            if request_id is None:
                if isinstance(item, Start) and item.request_id in self._subs:
                    request_id = item.request_id
                    self._bind(partition, ref, request_id)
                else:  # a turn nobody here follows, or one not known to be yet
                    if isinstance(item, TERMINAL) and self._unbound[partition]:
                        self._hold(partition, ref, Delivered(record.position, item, index),
                                   record.timestamp_ms)
                    continue
            subs = self._subs.get(request_id)
            if subs:
                delivered = Delivered(record.position, item, index)
                for sub in subs:
                    self._deliver(sub, delivered, record.timestamp_ms)

    @staticmethod
    def _deliver(sub: Subscription, delivered: Delivered, written_ms: int) -> None:
        """Push a live entry of ``sub``'s turn, from a record written at ``written_ms``."""
        assert delivered.position is not None
        if delivered.position.offset < sub.starts.get(LIVE, 0):
            return  # its reader reads it from the log
        if sub.first_live is None:
            sub.first_live = (written_ms, time.time_ns())
        sub.push(delivered)

    async def _route_legacy(self, record: Record) -> None:
        try:
            event = await self._codec.decode_async(record.value)
        except DecodeError:
            return  # the projector dead-letters it
        subs = self._subs.get(event.request_id)
        if subs and isinstance(event, GenerationEvent):
            delivered = legacy(record, event)
            if delivered is not None:
                for sub in subs:
                    if record.position.offset >= sub.starts.get(GENERATIONS, 0):
                        sub.push(delivered)

    async def _run(self) -> None:
        last_sweep = time.monotonic()
        while True:
            sweep = time.monotonic() - last_sweep > SWEEP_S
            if sweep:  # also while Kafka is away
                last_sweep = time.monotonic()
                self._sweep()
            try:
                records = await self._consumer.poll_batch(1000, 0.05)
                for record in records:
                    await self._route(record)
                if sweep:
                    await self._drop_idle()
                    await self._check_stalls()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._quiet.warning("the generation tail could not read Kafka; retrying: %r",
                                    exc)
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._consumer.close()
