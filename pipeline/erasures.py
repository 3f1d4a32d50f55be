"""The conversations whose data keys were destroyed lately, from ``chat.erasures``.

A destroyed key's record stays in ``chat.keys`` until the broker's compaction deletes it
(within the erasure window), and a reader that finds keys where content says they lie
could read it until then. So whoever destroys a conversation's keys also writes an
erasure to ``chat.erasures``: key the conversation id, value its tenant and when. Every
keyring follows that topic and refuses the keys of the conversations it names.

The topic keeps an erasure twice the erasure window, longer than the destroyed keys'
records can outlive their tombstones (the broker deletes them within one window), so
reading it whole costs the erasures of two windows, never the history. A tombstone
writer writes an erasure with its tombstones (``Keyring.destroy``), so the newest erasure
of a conversation is never older than its keys' tombstones.

An erasure is forgotten once two windows have passed by the earlier of two clocks: this
host's, and the newest time the brokers stamped on an erasure read (the topic is
``LogAppendTime``: no later than the brokers' now). A host whose clock runs a day ahead,
or a broker's that once did, would otherwise have forgotten erasures whose keys' records
could still be read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import msgspec

from pipeline.kafka import KafkaException, Record, unreachable
from pipeline.kafka.plain import PlainReader
from pipeline.logs import shown
from pipeline.retry import Backoff, QuietLog
from pipeline.topics import ERASURES

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long the following thread waits for records at a time. A record ends the wait
# when it comes, and the topic's writers are plain ones (no transaction markers to
# pass unseen), so this bounds only how often an idle follower wakes: 2 a second.
POLL_S = 0.5
PRUNE_EVERY_S = 60.0
# How often a long read to the end says how far it got.
PROGRESS_S = 5.0


class ErasuresUnavailable(RuntimeError):
    """``chat.erasures`` could not be read to its end: ``unreachable`` if Kafka did not
    answer, else for another reason the message says (a read that is slow, a topic that
    does not exist)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def erasure_record(conversation_id: uuid.UUID, tenant: str, by: str) -> tuple[bytes, bytes]:
    """The record key and value of an erasure of ``conversation_id``."""
    return str(conversation_id).encode(), json.dumps({
        "v": 1, "conversation_id": str(conversation_id), "tenant": tenant, "by": by,
        "at": int(time.time() * 1000)}).encode()


class _Written(msgspec.Struct):
    """Who wrote an erasure, and whose conversation it erased."""

    tenant: str = ""
    by: str = ""


# The writers whose erasures a tenant asked for (a session deleted through the API):
# ``Erasures.asked`` counts them, for a gateway's cap on a tenant's erasures. An
# operator's (``pipeline erase``) and the projector's are not counted.
ASKED_BY = "gateway"
_WRITTEN = msgspec.json.Decoder(_Written)


def _given(answer: dict[int, int] | KafkaException | None) -> dict[int, int]:
    assert answer is not None
    if isinstance(answer, KafkaException):
        raise KafkaException(*answer.args)
    return answer


class Erasures:
    """The erasures of the last ``horizon_s``, read to the end at ``start`` and followed
    on a thread of its own. ``revoked`` is a set look-up: it never waits."""

    def __init__(self, bootstrap: str, name: str, horizon_s: float, wait_s: float = 15.0
                 ) -> None:
        self._bootstrap, self._name = bootstrap, name
        self._horizon_s, self._wait_s = horizon_s, wait_s
        # A conversation's id (as an int) -> the minute it was erased in (one int object
        # per minute, shared): 86 MB a million erasures, where UUIDs and floats took 166
        # (tracemalloc). A bulk erasure's millions are held by every process for two
        # windows.
        self._at: dict[int, int] = {}
        self._minutes: dict[int, int] = {}  # each minute's one int object
        # A tenant -> the minute -> its erasures asked through the API (``asked``).
        self._asked: dict[str, dict[int, int]] = {}
        self._newest_ms = 0  # the newest time stamped on an erasure read (``_now``)
        self._lock = threading.Lock()
        self._read_to = threading.Condition(self._lock)  # notified as positions move
        self._positions: dict[int, int] = {}  # how far the thread has read, per partition
        self._failure: str | None = None
        self._unreachable = False
        self._quiet = QuietLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="erasures", daemon=True)
        # Ends are asked by the callers, on a client of their own: on the follower's
        # connection a request waits behind its fetch, which an idle broker holds for up
        # to half a second.
        self._asker: PlainReader | None = None
        self._asking = threading.Lock()
        # Callers that come while ends are being asked wait for the next ask, made once
        # for all of them (``_ends``): the requests are one per ask, not per caller.
        self._asks = threading.Condition()
        self._begun = 0  # asks begun so far
        self._in_flight = False
        self._answer: tuple[int, dict[int, int] | KafkaException] | None = None
        self._partitions: list[int] = []
        self._pruned = time.monotonic()
        self.read = 0  # records read so far (a slow start says how far it got)
        self.unreadable = 0  # of them, records that are not erasures

    def start(self) -> None:
        self._asker = PlainReader(self._bootstrap, f"{self._name}-erasures-ends")
        try:
            self._partitions = self._retrying(lambda: self._asker_().partitions(ERASURES))
        except KafkaException as exc:
            raise ErasuresUnavailable(f"Kafka does not answer for {ERASURES}: {exc}",
                                      unreachable=unreachable(exc)) from None
        if not self._partitions:
            raise ErasuresUnavailable(f"the topic {ERASURES} does not exist: `pipeline "
                                      "topics` makes it")
        self._thread.start()
        if not self.catch_up():
            raise self.unavailable()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._asking:
            if self._asker is not None:
                self._asker.close()
                self._asker = None

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        return conversation_id.int in self._at

    def add(self, conversation_id: uuid.UUID) -> None:
        """An erasure this process made (before its record is read back)."""
        with self._lock:
            self._at.setdefault(conversation_id.int, self._minute(self._now()))

    def asked(self, tenant: str, now: float | None = None) -> tuple[int, float]:
        """The erasures ``tenant`` asked for through the API in the last erasure window
        (half the horizon), and how long until the oldest of them leaves it (s). ``now``:
        the brokers' time, as the caller reads it (the erasures are stamped by them);
        this host's clock if not given."""
        now = time.time() if now is None else now
        since = int((now - self._horizon_s / 2) // 60)
        with self._lock:
            minutes = {m: n for m, n in self._asked.get(tenant, {}).items() if m >= since}
        if not minutes:
            return 0, 0.0
        return sum(minutes.values()), max((min(minutes) + 1) * 60 + self._horizon_s / 2
                                          - now, 1.0)

    def _now(self) -> float:
        """Now, as far as forgetting goes: the earlier of this host's clock and the newest
        time read off the log, which is that of the brokers (this host's alone before the
        first erasure is read)."""
        return min(time.time(), self._newest_ms / 1000) if self._newest_ms else time.time()

    def _minute(self, at: float) -> int:
        minute = int(at // 60)
        return self._minutes.setdefault(minute, minute)

    def __len__(self) -> int:
        return len(self._at)

    def catch_up(self) -> bool:
        """Wait until the thread has read the topic to its end as it is now; False if it
        read nothing for the wait (``unavailable`` says why)."""
        if not self._thread.is_alive():
            return False
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                ends = self._ends()
                break
            except KafkaException as exc:  # a leader moving, or Kafka away: asked again
                if time.monotonic() > deadline or self._stop.is_set():
                    self._unreachable = True
                    self._quiet.warning("Kafka does not answer for %s: %s", ERASURES, exc)
                    return False
                time.sleep(0.2)
        self._unreachable = False
        # The wait is for progress, not for the whole read: a start behind many erasures
        # (a bulk erasure's millions) reads on while records keep coming, and says so.
        read, said = self.read, time.monotonic()
        with self._lock:
            while True:
                if self._read_to.wait_for(
                        lambda: self._failure is not None or all(
                            self._positions.get(p, 0) >= end for p, end in ends.items()),
                        min(max(deadline - time.monotonic(), 0.0), PROGRESS_S)):
                    return self._failure is None
                now = time.monotonic()
                if self.read > read:
                    deadline, read = now + self._wait_s, self.read
                elif now >= deadline:
                    return False
                if now - said >= PROGRESS_S:
                    said = now
                    left = sum(max(end - self._positions.get(p, 0), 0)
                               for p, end in ends.items())
                    log.info("reading %s: %s records read, %s to go", ERASURES,
                             f"{self.read:,}", f"{left:,}")

    def _ends(self) -> dict[int, int]:
        """The topic's ends, asked after this call began (an erasure written before it
        is within them). A caller that comes while an ask is under way, begun before it
        came, waits for the next ask, which one of those waiting makes for all of them."""
        with self._asks:
            wanted = self._begun + 1  # the first ask begun from now on answers
            while self._answer is None or self._answer[0] < wanted:
                if not self._in_flight:
                    break
                self._asks.wait()
            else:
                return _given(self._answer[1])
            self._in_flight = True
            self._begun += 1
            number = self._begun
        answer: dict[int, int] | KafkaException | None = None
        try:
            with self._asking:
                answer = self._asker_().ends(ERASURES, self._partitions, self._wait_s)
        except KafkaException as exc:
            answer = exc
        finally:  # whatever it raised, those waiting are let go (one asks again)
            with self._asks:
                self._in_flight = False
                if answer is not None:
                    self._answer = (number, answer)
                self._asks.notify_all()
        return _given(answer)

    def unavailable(self) -> ErasuresUnavailable:
        if self._failure is not None:
            return ErasuresUnavailable(self._failure, self._unreachable)
        if self._unreachable:
            return ErasuresUnavailable(f"Kafka does not answer for {ERASURES}",
                                       unreachable=True)
        return ErasuresUnavailable(
            f"could not read {ERASURES} to its end: nothing read for {self._wait_s:g} s "
            f"({self.read:,} records read so far), though Kafka answers")

    def _asker_(self) -> PlainReader:
        if self._asker is None:
            raise ErasuresUnavailable("closed")
        return self._asker

    # -- the thread ---------------------------------------------------------------
    def _follow(self) -> None:
        """Follow the topic until ``close``. Kafka away, or a client that failed, is waited
        out (a reader made anew carries on where the last one was): the thread never
        stops for it, or every later look-up would fail as if for good."""
        reader: PlainReader | None = None
        backoff = Backoff(0.2, 5.0)
        try:
            while not self._stop.is_set():
                try:
                    if reader is None:
                        reader = self._reader()
                    self._apply(reader.read(1000, timeout=POLL_S))
                    moved = {p: reader.position(ERASURES, p) for p in self._partitions}
                    with self._lock:
                        self._positions.update({p: o for p, o in moved.items() if o >= 0})
                        self._read_to.notify_all()
                    backoff.reset()
                except KafkaException as exc:
                    self._quiet.warning("following %s: %s (reading on)", ERASURES, exc)
                    if reader is not None:
                        with contextlib.suppress(KafkaException):
                            reader.close()
                        reader = None
                    self._stop.wait(backoff.next())
                if time.monotonic() - self._pruned > PRUNE_EVERY_S:
                    self._prune()
        except Exception as exc:  # a bug: the waiters learn it from the failure
            log.exception("stopped following %s", ERASURES)
            with self._lock:
                self._failure = f"reading {ERASURES} failed: {exc}"
                self._read_to.notify_all()
        finally:
            if reader is not None:
                reader.close()

    def _reader(self) -> PlainReader:
        """A reader from where the thread has read to (the partitions' starts at first)."""
        with self._asking:
            asker = self._asker_()
            starts = {(ERASURES, p): max(self._positions.get(p, 0),
                                         asker.bounds(ERASURES, p, self._wait_s)[0])
                      for p in self._partitions}
        reader = PlainReader(self._bootstrap, f"{self._name}-erasures")
        reader.start(starts)
        return reader

    def _retrying(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                return call()
            except KafkaException:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2)

    def _apply(self, records: list[Record]) -> None:
        if not records:
            return
        with self._lock:
            self._newest_ms = max(self._newest_ms, max(r.timestamp_ms for r in records))
            horizon = self._now() - self._horizon_s
            for record in records:
                self.read += 1
                try:
                    conversation = uuid.UUID((record.key or b"").decode())
                except ValueError:
                    self.unreadable += 1
                    self._quiet.warning("%s holds records that are not erasures (%d so far; "
                                        "one keyed %s)", ERASURES, self.unreadable,
                                        shown(record.key))
                    continue
                at = record.timestamp_ms / 1000
                if at >= horizon:
                    minute = self._minute(at)
                    if minute > self._at.get(conversation.int, 0):
                        self._at[conversation.int] = minute
                    self._count(record.value, minute)

    def _count(self, value: bytes | None, minute: int) -> None:
        try:
            written = _WRITTEN.decode(value or b"{}")
        except msgspec.DecodeError:
            return  # counted by no tenant; its conversation is erased all the same
        if written.by.startswith(ASKED_BY):
            counts = self._asked.setdefault(written.tenant, {})
            counts[minute] = counts.get(minute, 0) + 1

    def _prune(self) -> None:
        """Forget erasures past the horizon: their keys' records are gone from the log."""
        self._pruned = time.monotonic()
        with self._lock:
            horizon = int((self._now() - self._horizon_s) // 60)  # up to a minute longer
            for conversation in [c for c, minute in self._at.items() if minute < horizon]:
                del self._at[conversation]
            for minute in [m for m in self._minutes if m < horizon]:
                del self._minutes[minute]
            for tenant, counts in list(self._asked.items()):
                for minute in [m for m in counts if m < horizon]:
                    del counts[minute]
                if not counts:
                    del self._asked[tenant]
