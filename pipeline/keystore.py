"""The conversations' data keys as a process holds them: the ones it works with, in a
bounded cache, and any other found where the content that needs it says it lies
(``pipeline.sealing``, ``docs/erasure.md``).

A key's record is in ``chat.keys`` (``pipeline.kek``); a sealed box names it by
reference, the record's partition and offset, so a key not held is one fetch away,
whatever the topic holds besides. Nothing is read at start but ``chat.erasures``: the
conversations whose keys were destroyed within the last two erasure windows
(``pipeline.erasures``). A key of such a conversation is refused, cached or fetched: its
record may still be in ``chat.keys`` until the broker compacts it away, and a reader
must not open what it sealed meanwhile. Past the horizon its record is gone, and a fetch
finds nothing at its offset.

Start-up, memory and each look-up cost the same whatever number of conversations the
log has held: ``KEY_CACHE`` keys at most (about 2.7 KB each), and the erasures of two
windows.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeVar

from pipeline import sealing
from pipeline.codec import Codec, conversation_key
from pipeline.digests import Digester
from pipeline.erasures import Erasures, ErasuresUnavailable, erasure_record
from pipeline.kafka import KafkaException, ProduceError, Record
from pipeline.kafka.lookup import Lookup, PositionReader
from pipeline.kafka.plain import PlainWriter
from pipeline.kek import (
    Kek,
    KekError,
    KeyInfo,
    KeyRef,
    key_info,
    load_kek,
    load_previous_keks,
    parse_record_key,
    record_key,
)
from pipeline.keycache import GONE, KeyCache
from pipeline.keyindex import legacy_index
from pipeline.keylimits import ROTATIONS_FRESH_S, KeyringError, KeyringLimits, NewKey
from pipeline.layout import check_layout
from pipeline.partitioning import partition_for
from pipeline.retry import Backoff, QuietLog
from pipeline.rotations import Rotation, find_moved, read_rotations, rotations_at_start
from pipeline.settings import CommonSettings
from pipeline.topics import ERASURES, KEYS

log = logging.getLogger(__name__)
T = TypeVar("T")
_REFUSED = object()  # its conversation is erased
_FOREIGN = object()  # wrapped by a KEK this process does not have


class Keyring:
    """See the module. ``start`` reads ``chat.erasures`` and checks the key-encryption
    key against the newest keys; look-ups then read ``chat.keys`` at the places asked."""

    def __init__(self, bootstrap: str, kek: bytes, name: str,
                 limits: KeyringLimits | None = None,
                 previous: Sequence[bytes] = ()) -> None:
        # ``previous``: the KEKs a rotation replaces, accepted to unwrap meanwhile.
        self._kek = Kek(kek, previous)
        self.fingerprint = self._kek.fingerprint
        self.digests = Digester(kek, previous)  # what the log keeps of a client's words
        self._rotations: list[Rotation] = []
        self._rotations_read = 0.0  # when (monotonic)
        limits = limits or KeyringLimits()
        self._bootstrap, self._name, self._limits = bootstrap, name, limits
        self.erasures = Erasures(bootstrap, name, 2 * limits.erasure_window_s,
                                 limits.wait_s)
        self._cache = KeyCache(limits.cache, self.erasures.revoked)
        self._fetching = threading.Lock()  # one look-up at a time on the reader
        self._reader: PositionReader | None = None
        self._partitions = 0
        self._legacy: dict[str, tuple[int, int]] | None = None
        self._writer: PlainWriter | None = None
        self._quiet = QuietLog(log)
        self.fetches = 0  # look-ups that read chat.keys
        # Seals and opens content with this ring's keys.
        self.codec = Codec(sealing.Cipher(self))

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> Keyring:
        """Read ``chat.erasures`` to its end; check the topics (``pipeline.layout``), and the
        key-encryption key against each ``chat.keys`` partition's newest record
        (``KeyringError`` if another one wrapped it). Content is sealed with it (``codec``)."""
        try:
            self.erasures.start()
        except ErasuresUnavailable as exc:
            raise KeyringError(str(exc), unreachable=exc.unreachable) from None
        self._reader = PositionReader(self._bootstrap, KEYS, f"{self._name}-keys")
        try:
            partitions = self._retrying(lambda: self._reader_().partitions(self._limits.wait_s))
            if not partitions:
                raise KeyringError(f"the topic {KEYS} does not exist: `pipeline topics` makes it")
            self._partitions = len(partitions)
            self._rotations, layout = self._retrying(  # a rotation not finished: refused
                lambda: rotations_at_start(self._bootstrap, self._name, self._limits.wait_s,
                                           self._kek.knows))
            check_layout(self._bootstrap, self._name, self._partitions, layout, self._retrying,
                         self._limits)
            self._rotations_read = time.monotonic()
            self._check_kek(partitions)
        except KafkaException as exc:
            self.close()
            raise KeyringError(f"Kafka does not answer for {KEYS}: {exc}",
                               unreachable=True) from None
        except BaseException:
            self.close()
            raise
        return self

    def _check_kek(self, partitions: list[int]) -> None:
        newest = []
        for partition in partitions:
            low, high = self._retrying(
                lambda p=partition: self._reader_().bounds(p, self._limits.wait_s))  # type: ignore[misc]
            if high > low:
                newest.append((partition, high - 1))
        replaced = {f for r in self._rotations for f in r.replaced}
        for record in self._read(newest).found.values():
            if record.value is not None:
                try:
                    self._kek.unwrap(record.key, record.value, "check")
                except KekError as exc:
                    info = _info(record)
                    if info is not None and info.kek in replaced:
                        continue  # a rotation wrote it anew: found in its window
                    raise KeyringError(str(exc)) from None
                except ValueError:
                    continue  # not a key: a reader of it says so
                return

    def _retrying(self, call: Callable[[], T]) -> T:
        """``call``, asked again while Kafka says a leader is moving (a topic just made,
        a broker restarted), for up to the wait."""
        deadline = time.monotonic() + self._limits.wait_s
        while True:
            try:
                return call()
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        self.erasures.close()
        with self._fetching:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        if self._writer is not None:
            self._writer.flush(10)

    def __enter__(self) -> Keyring:
        return self if self._reader is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what sealing asks ---------------------------------------------------------
    def for_writing(self, conversation_id: uuid.UUID) -> sealing.DataKey | Literal[
            "erased"] | None:
        """The key this process sealed or opened the conversation's content with last, if
        it still holds it; ``"erased"`` if the conversation's keys were destroyed."""
        if self.erasures.revoked(conversation_id):
            return "erased"
        return self._cache.current(conversation_id)

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        return self.erasures.revoked(conversation_id)

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        held = self._held(key_id)
        if held is not None:
            return None if held is GONE else held  # type: ignore[return-value]
        if not wait:
            raise sealing.KeyNotHeld(key_id, written_at)
        return self._look_up(key_id, written_at)

    def holds(self, key_id: str) -> bool:
        """Whether the key is held, or known gone (asking it never reads the log)."""
        return self._held(key_id) is not None

    def prefetch(self, wanted: Iterable[str]) -> int:
        """Read the keys of the ids ``wanted`` not held yet in one fetch, and hold those
        found after one look at the erasures' end, as their look-ups would. A key not
        found, refused or not unwrapped, or one of a partition the topic lacks (a hostile
        box's: the read would wait out its timeout), is left to its own look-up, as are
        fewer than two. The number held."""
        refs = {key_id: ref for key_id in wanted
                if self._held(key_id) is None and (ref := KeyRef.parse(key_id)) is not None
                and ref.partition < self._partitions}
        if len(refs) < 2:
            return 0
        with self._fetching:
            refs = {key_id: ref for key_id, ref in refs.items() if self._held(key_id) is None}
            if not refs:
                return 0
            lookup = self._read([(ref.partition, ref.offset) for ref in refs.values()])
            if not self.erasures.catch_up():
                return 0
        found = {id(record) for record in lookup.found.values()}
        nearby = [record for record in lookup.nearby if id(record) not in found]
        held = 0
        for key_id, ref in refs.items():
            record = lookup.found.get((ref.partition, ref.offset))
            key = self._unwrapped(record, ref.short_id, key_id) if record is not None else None
            held += isinstance(self._held_now(key, nearby), sealing.DataKey)
            nearby = []  # the records read ahead are held once
        return held

    def hold_read(self, records: Sequence[Record]) -> int:
        """Hold the keys of ``records`` of ``chat.keys``, read by a reader of that topic
        (the projector), as a look-up holds what it reads: after the erasures are read to
        their end, so that no key is held whose erasure was written first. If they
        cannot be read, none is held (a look-up says why). The number held."""
        fresh = {ref: record for record in records
                 if record.value is not None and record.position.topic == KEYS
                 and (ref := _ref_of(record)) is not None and ref not in self._cache}
        if not fresh or not self.erasures.catch_up():
            return 0
        for record in fresh.values():
            self._hold_nearby(record)
        return sum(1 for ref in fresh if ref in self._cache)

    def fetch(self, key_id: str) -> sealing.DataKey | None:
        """The key of that reference, held or read where it lies (None: destroyed). For
        a writer that names the conversation's key it found in the store."""
        key = self.for_reading(key_id)
        if key is not None:
            self._cache.seals(key)
        return key

    # -- what writers ask ------------------------------------------------------------
    def new_key(self, conversation_id: uuid.UUID, tenant: str, user: str | None) -> NewKey:
        """A new data key for the conversation, to write before anything is sealed with
        it, then ``placed``."""
        key, secret = sealing.new_data_key(conversation_id)
        user_digest = self.digests.digest("user", tenant, user) if user is not None else None
        return NewKey(conversation_id, key.key_id, key.aead,
                      record_key(conversation_id, key.key_id),
                      self._kek.wrap(conversation_id, key.key_id, secret, tenant, user_digest),
                      self.partition_of(conversation_id))

    def partition_of(self, conversation_id: uuid.UUID) -> int:
        """The partition of ``chat.keys`` the conversation's keys go to: its own number, so
        a reader of a chat topic's partition in order finds their keys in order too."""
        return partition_for(conversation_key(conversation_id), self._partitions or 1)

    def placed(self, new: NewKey, offset: int) -> sealing.DataKey:
        """The key whose record ``chat.keys`` acknowledged at ``offset``: held, and the
        one this process seals the conversation's content with from now on."""
        key = sealing.DataKey(str(KeyRef(new.short_id, new.partition, offset)),
                              new.conversation_id, new.aead)
        self._cache.seals(key)
        return key

    # -- what deleters ask ------------------------------------------------------------
    def erasure(self, conversation_id: uuid.UUID, tenant: str) -> tuple[bytes, bytes]:
        """The record of ``chat.erasures`` that erases the conversation, to write; this
        process refuses its keys at once."""
        self.erasures.add(conversation_id)
        return erasure_record(conversation_id, tenant, self._name)

    def tombstone(self, conversation_id: uuid.UUID, key_id: str) -> tuple[bytes, int]:
        """A key's tombstone: its record key, and its partition of ``chat.keys``."""
        ref = KeyRef.parse(key_id)
        key = record_key(conversation_id, ref.short_id if ref else key_id)
        return key, ref.partition if ref else partition_for(key, self._partitions or 1)

    def destroy(self, doomed: Iterable[tuple[uuid.UUID, str, Iterable[str]]],
                timeout: float = 30.0) -> int:
        """Erase these conversations (id, tenant, key ids) and write their keys'
        tombstones, from this thread (the projector, ``pipeline erase``), all acknowledged
        together: the number of tombstones. Each erasure goes with its tombstones, so the
        newest erasure of a conversation is never older than its keys' tombstones
        (``pipeline.erasures``)."""
        if self._writer is None:
            self._writer = PlainWriter(self._bootstrap, f"{self._name}-keys")
        writer = self._writer
        written = 0
        for conversation_id, tenant, key_ids in doomed:
            writer.send(ERASURES, *self.erasure(conversation_id, tenant))
            for key_id in key_ids:
                key, partition = self.tombstone(conversation_id, key_id)
                writer.send(KEYS, key, None, partition)
                written += 1
        failed = writer.flush(timeout)
        if failed:
            raise ProduceError(f"erasures not acknowledged: {failed[0]}")
        return written

    def catch_up(self) -> bool:
        """Whether ``chat.erasures`` was read to its end as it is now."""
        return self.erasures.catch_up()

    def size(self) -> int:
        return len(self._cache)

    def erased(self) -> int:
        """The conversations erased within the horizon, as this process knows them."""
        return len(self.erasures)

    # -- holding --------------------------------------------------------------------
    def _held(self, key_id: str) -> sealing.DataKey | object | None:
        """The key if held, ``GONE`` if known destroyed, None if not known."""
        return GONE if key_id == sealing.ERASED else self._cache.get(key_id)

    # -- looking up -------------------------------------------------------------------
    def _look_up(self, key_id: str, written_at: float | None) -> sealing.DataKey | None:
        """Read the key where its reference says (see ``MISSING_WAIT_S``)."""
        recent = written_at is not None and time.time() - written_at < self._limits.erasure_window_s
        deadline = time.monotonic() + (self._limits.missing_wait_s if recent else 0.0)
        backoff = Backoff(0.5, 5.0)
        while True:
            with self._fetching:
                held = self._held(key_id)  # another thread may have brought it meanwhile
                if held is not None:
                    return None if held is GONE else held  # type: ignore[return-value]
                ref = KeyRef.parse(key_id) or self._legacy_ref(key_id)
                if ref is None or ref.partition >= self._partitions:  # its count is fixed
                    return self._destroyed(key_id)  # never to be found: not waited for
                lookup = self._read([(ref.partition, ref.offset)])
                # A key fetched after its erasure was written is refused: read the
                # erasures to their end as they are now, after the key.
                if not self.erasures.catch_up():
                    exc = self.erasures.unavailable()
                    raise KeyringError(str(exc), unreachable=exc.unreachable)
            found = self._taken(lookup, ref, key_id)
            if isinstance(found, sealing.DataKey):
                return found
            if found is _REFUSED:
                return self._destroyed(key_id, "refused")
            if (ref.partition, ref.offset) not in lookup.beyond:
                # Not there, or wrapped by a KEK this process no longer has: a rotation
                # may have written it anew.
                moved = self._moved(ref, key_id)
                if moved is not None:
                    return moved
                if found is _FOREIGN:
                    raise KeyringError(f"key {key_id} is wrapped by a key-encryption key "
                                       "this process does not have, and no rotation wrote "
                                       "it anew: give every process the same PIPELINE_KEK")
                return self._destroyed(key_id)
            left = deadline - time.monotonic()
            if left <= 0:
                return self._destroyed(key_id)
            self._quiet.warning("data key %s of content written %.0f s ago is past the end "
                                "of %s as its leader answered: looking again for %.0f s "
                                "more", key_id, time.time() - (written_at or 0), KEYS, left)
            time.sleep(min(backoff.next(), left))

    def _read(self, wanted: list[tuple[int, int]]) -> Lookup:
        reader = self._reader_()
        self.fetches += 1
        try:
            return reader.read(wanted, self._limits.wait_s)
        except (TimeoutError, KafkaException) as exc:
            raise KeyringError(f"could not read {KEYS}: {exc}", unreachable=True) from None

    def _reader_(self) -> PositionReader:
        if self._reader is None:
            raise KeyringError("the keyring is closed")
        return self._reader

    def _taken(self, lookup: Lookup, ref: KeyRef, key_id: str) -> sealing.DataKey | object:
        """The key the look-up found at ``ref`` (held from now on), else why not:
        ``_REFUSED`` (its conversation erased), ``_FOREIGN`` (wrapped by a KEK this
        process does not have), None (not there); and, reading ahead, the keys found on
        the way."""
        record = lookup.found.get((ref.partition, ref.offset))
        key = self._unwrapped(record, ref.short_id, key_id) if record is not None else None
        return self._held_now(key, [r for r in lookup.nearby if r is not record])

    def _held_now(self, key: sealing.DataKey | object, nearby: list[Record]
                  ) -> sealing.DataKey | object:
        # Keys read ahead first, at most an eighth of the cache, then the one asked: so
        # they never push it, nor most of what is held, out of a small cache.
        if self._limits.read_ahead:
            for other in nearby[:max(self._limits.cache // 8, 1)]:
                self._hold_nearby(other)
        if isinstance(key, sealing.DataKey):
            if self.erasures.revoked(key.conversation_id):
                key = _REFUSED
            else:
                self._cache.hold(key, seals_unless_set=True)
        return key

    def _moved(self, ref: KeyRef, key_id: str) -> sealing.DataKey | None:
        """The key a rotation wrote anew (``pipeline.rotations``), looked for in the window
        of each rotation since it was made, newest first; None if none did."""
        if time.monotonic() - self._rotations_read > ROTATIONS_FRESH_S:
            try:
                self._rotations = read_rotations(self._bootstrap, self._name, self._limits.wait_s)
            except (KafkaException, TimeoutError) as exc:
                raise KeyringError(f"could not read the rotations: {exc}",
                                   unreachable=True) from None
            self._rotations_read = time.monotonic()
        for rotation in self._rotations:
            window = rotation.windows.get(ref.partition)
            if window is None or window[0] <= ref.offset:
                continue  # made after the rotation began: never moved by it
            end = window[1] if window[1] is not None else self._reader_().bounds(
                ref.partition, self._limits.wait_s)[1]
            with self._fetching:
                record = find_moved(self._read, ref.partition, (window[0], end), ref.offset,
                                    ref.short_id)
            if record is None:
                continue
            key = self._unwrapped(record, ref.short_id, key_id)
            held = self._held_now(key, [])
            if isinstance(held, sealing.DataKey):
                return held
        return None

    def _hold_nearby(self, record: Record) -> None:
        parsed = parse_record_key(record.key)
        ref = _ref_of(record)
        if parsed is None or ref is None or record.value is None:
            return
        if ref in self._cache or self.erasures.revoked(parsed[0]):
            return
        try:
            self._cache.hold(self._kek.unwrap(record.key, record.value, ref))
        except ValueError:
            return

    def _unwrapped(self, record: Record, short_id: str, key_id: str
                   ) -> sealing.DataKey | object | None:
        parsed = parse_record_key(record.key)
        if record.value is None or parsed is None or parsed[1] != short_id:
            return None  # a tombstone, or another record: not the key it names
        try:
            return self._kek.unwrap(record.key, record.value, key_id)
        except KekError:
            return _FOREIGN
        except ValueError as exc:
            log.error("%s record %s is not a data key this process can unwrap: %s", KEYS,
                      record.position, exc)
            return None

    def _destroyed(self, key_id: str, why: str = "") -> sealing.DataKey | None:
        """None: the key is not where it was, or its conversation is erased (``why``):
        what it sealed reads as erased."""
        if why:
            log.info("data key %s is refused (its conversation is in %s, or its place holds "
                     "another record): what it sealed reads as erased", key_id, ERASURES)
        else:
            self._quiet.warning("data key %s is not in %s where it was: what it sealed "
                                "reads as erased", key_id, KEYS)
        self._cache.forget(key_id)
        return None

    def _legacy_ref(self, short_id: str) -> KeyRef | None:
        """Where a key named by its short id alone lies (written before references named
        their place): found in an index of such keys, made by reading ``chat.keys`` once,
        the first time one is asked for. A short id has no dots: an id with them that
        is no reference (a hostile box's) is none, and reads no index."""
        if "." in short_id:
            return None
        if self._legacy is None:
            self._legacy = legacy_index(self._bootstrap, self._reader_(), self._limits.wait_s)
        place = self._legacy.get(short_id)
        return KeyRef(short_id, *place) if place is not None else None


def _info(record: Record) -> KeyInfo | None:
    try:
        return key_info(record.key, record.value or b"")
    except ValueError:
        return None


def _ref_of(record: Record) -> str | None:
    """The id of the data key ``record`` of ``chat.keys`` holds: its place (``KeyRef``)."""
    parsed = parse_record_key(record.key)
    return None if parsed is None else str(
        KeyRef(parsed[1], record.position.partition, record.position.offset))


def open_keyring(common: CommonSettings, name: str, read_ahead: bool = False,
                 reading: bool = False) -> Keyring:
    """This process's keyring, started (``reading``: see ``KeyringLimits.refuse_topics``)."""
    try:
        kek, previous = load_kek(common), load_previous_keks(common)
    except KekError as exc:
        raise KeyringError(str(exc)) from None
    limits = KeyringLimits(cache=common.key_cache, read_ahead=read_ahead,
                           topics=common.topic_policy(), refuse_topics=not reading)
    return Keyring(common.kafka_bootstrap, kek, name, limits, previous).start()
