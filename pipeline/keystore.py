"""The conversations' data keys, kept in ``chat.keys`` and held by every process that
reads or writes content (``pipeline.sealing``, ``docs/erasure.md``).

A record of ``chat.keys`` is one data key: key ``<conversation>/<key id>``, value the
key wrapped (AES-256-GCM) by the key-encryption key, with the conversation's tenant and
user. A conversation may have several keys (two gateways that gave its first turn one
each at once): every box names its key. Destroying a conversation's keys writes a
tombstone per key; the topic is compacted, so the broker deletes the key's record
within ``PIPELINE_ERASURE_WINDOW_MS``.

``Keyring`` reads the whole topic on a thread of its own and keeps every live key in
memory (about 200 bytes each). A key it does not know yet (written by another process
a moment ago) is looked for by reading the topic up to its end as it is then: a key is
durable before any content sealed with it is written, so it is found if it exists.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pipeline import sealing
from pipeline.kafka import BEGINNING, KafkaException, ProduceError, Record, unreachable
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.retry import QuietLog
from pipeline.settings import CommonSettings
from pipeline.topics import KEYS

log = logging.getLogger(__name__)
T = TypeVar("T")
# How long the following thread waits for records at a time, and how long a reader that
# misses a key waits for the thread to bring it before reading the topic to its end.
POLL_S = 0.02
MISS_WAIT_S = 0.05
# A key not found up to the end of ``chat.keys``, for content written less than the
# erasure window ago, is looked for again for this long before that content reads as
# erased: the end may have come from a broker that lost its leadership without knowing
# (a leader cut off from its peers answers with the end it had, and new keys are
# written to its successor). Content older than the window may have outlived its key
# and the key's tombstone, both compacted away: not found then means destroyed.
MISSING_WAIT_S = 120.0


class KeyringError(sealing.RingUnavailable):
    """The keyring cannot serve: a key wrapped by another key-encryption key, or
    ``chat.keys`` not readable to its end in time (``unreachable``)."""


def load_kek(common: CommonSettings) -> bytes:
    """The key-encryption key: ``PIPELINE_KEK``, else the file ``PIPELINE_KEK_FILE``
    (``<state dir>/kek``), made there with a new key if it does not exist."""
    if common.kek is not None:
        text = common.kek.get_secret_value()
        source = "PIPELINE_KEK"
    else:
        path = common.kek_file or common.state_dir / "kek"
        if not path.exists():
            _make_kek_file(path)
        text = path.read_text().strip()
        source = str(path)
    try:
        kek = base64.b64decode(text, validate=True)
    except ValueError:
        kek = b""
    if len(kek) != 32:
        raise KeyringError(f"{source} is not a key-encryption key: base64 of 32 bytes "
                           "(`head -c 32 /dev/urandom | base64` makes one)")
    return kek


def _make_kek_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process of the stack made it first
        return
    with os.fdopen(fd, "w") as out:
        out.write(base64.b64encode(AESGCM.generate_key(bit_length=256)).decode() + "\n")
    log.warning("made a key-encryption key at %s: every process of this stack must have "
                "it; set PIPELINE_KEK (from your secret store) in production", path)


def fingerprint(kek: bytes) -> str:
    return hashlib.sha256(b"pipeline-kek" + kek).hexdigest()[:16]


@dataclass(frozen=True)
class Owner:
    tenant: str
    user: str | None


class _CatchUp:
    """A wait for the keyring's thread to read ``chat.keys`` to its end: ``done`` once it
    tried, ``read`` if it did."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.read = False


class Keyring:
    """Every data key in ``chat.keys`` (see the module). ``start`` reads the topic to
    its end, then a thread follows it."""

    def __init__(self, bootstrap: str, kek: bytes, name: str, wait_s: float = 15.0,
                 erasure_window_s: float = 86_400.0,
                 missing_wait_s: float = MISSING_WAIT_S) -> None:
        self._kek = AESGCM(kek)
        self.fingerprint = fingerprint(kek)
        self._bootstrap = bootstrap
        self._name = name
        self._wait_s = wait_s
        self._erasure_window_s = erasure_window_s
        self._missing_wait_s = missing_wait_s
        self._lock = threading.Lock()
        # Notified whenever the thread has applied what it read (new keys among it).
        self._applied = threading.Condition(self._lock)
        self._keys: dict[str, sealing.DataKey] = {}
        self._of: dict[uuid.UUID, list[str]] = {}
        self._owners: dict[uuid.UUID, Owner] = {}
        self._erased: set[uuid.UUID] = set()
        self._gone: set[str] = set()  # key ids looked for to the topic's end, not found
        self._pending: list[_CatchUp] = []
        # Why the keyring cannot serve at all (its thread stopped, or a key wrapped by
        # another key-encryption key), and whether that is Kafka away.
        self._failure: str | None = None
        self._unreachable = False
        # Why the last catch-up could not read to the end (Kafka away; the next tries).
        self._missed: str | None = None
        self._quiet = QuietLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="keyring", daemon=True)
        self._writer: PlainWriter | None = None

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> Keyring:
        """Read ``chat.keys`` to its end (``KeyringError`` if a key in it was wrapped by
        another key-encryption key), follow it from then on, and seal and open this
        process's content with it."""
        self._thread.start()
        if not self.catch_up():
            raise self._unavailable()
        if self._failure:
            raise KeyringError(self._failure)
        sealing.install(self)
        return self

    def close(self) -> None:
        sealing.uninstall(self)
        self._stop.set()
        self._thread.join(5)
        if self._writer is not None:
            self._writer.flush(10)

    def __enter__(self) -> Keyring:
        return self if self._thread.is_alive() else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what sealing asks ---------------------------------------------------------
    def for_writing(self, conversation_id: uuid.UUID) -> sealing.DataKey | Literal[
            "erased"] | None:
        with self._lock:
            ids = self._of.get(conversation_id)
            if ids:
                return self._keys[ids[0]]
            return "erased" if conversation_id in self._erased else None

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        with self._lock:
            key = self._keys.get(key_id)
            if key is not None or key_id in self._gone:
                return key
            if not wait:
                raise sealing.KeyNotHeld(key_id, written_at)
            # Most often made a moment ago, and on its way to the thread already: a wait
            # of milliseconds, not a read to the topic's end.
            self._applied.wait_for(lambda: key_id in self._keys, MISS_WAIT_S)
            key = self._keys.get(key_id)
            if key is not None:
                return key
        # Written a moment ago by another process, or gone (see MISSING_WAIT_S).
        recent = written_at is not None and time.time() - written_at < self._erasure_window_s
        deadline = time.monotonic() + (self._missing_wait_s if recent else 0.0)
        pause = 0.5
        while True:
            if not self.catch_up():
                raise self._unavailable(f"key {key_id} can be neither found nor known to "
                                        "be gone")
            with self._lock:
                key = self._keys.get(key_id)
                if key is not None or key_id in self._gone:  # a tombstone read meanwhile
                    return key
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._quiet.warning("data key %s of content written %.0f s ago is not in %s up "
                                "to its end: looking again for %.0f s more", key_id,
                                time.time() - (written_at or 0), KEYS, left)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 5.0)
        log.warning("data key %s is not in %s up to its end: what it sealed reads as "
                    "erased", key_id, KEYS)
        with self._lock:
            self._gone.add(key_id)
        return None

    # -- what the gateway and ``pipeline erase`` ask -----------------------------------
    def has_key(self, conversation_id: uuid.UUID) -> bool:
        with self._lock:
            return bool(self._of.get(conversation_id))

    def new_key(self, conversation_id: uuid.UUID, tenant: str, user: str | None
                ) -> tuple[bytes, bytes, sealing.DataKey]:
        """A new data key for the conversation: its record's key and value, to write
        (and wait for) before anything is sealed with it, then ``add``."""
        while True:  # 64-bit ids: one the log already knows is drawn again
            key, secret = sealing.new_data_key(conversation_id)
            with self._lock:
                if key.key_id not in self._keys and key.key_id not in self._gone:
                    break
        nonce = os.urandom(sealing.NONCE_BYTES)
        wrapped = self._kek.encrypt(nonce, secret, _aad(conversation_id, key.key_id))
        value = json.dumps({
            "v": 1, "conversation_id": str(conversation_id), "key_id": key.key_id,
            "tenant": tenant, "user": user, "kek": self.fingerprint,
            "wrapped": base64.b64encode(nonce + wrapped).decode(),
            "at": int(time.time() * 1000)}).encode()
        return _record_key(conversation_id, key.key_id), value, key

    def add(self, key: sealing.DataKey, owner: Owner) -> None:
        with self._lock:
            self._hold(key, owner)

    def tombstones(self, *conversations: uuid.UUID) -> list[bytes]:
        """The record keys of every key of these conversations (read to the topic's end
        first, once), to write as tombstones, then ``forget``."""
        if not self.catch_up():
            raise self._unavailable()
        with self._lock:
            return [_record_key(c, k) for c in conversations for k in self._of.get(c, ())]

    def forget(self, conversation_id: uuid.UUID) -> None:
        with self._lock:
            self._drop(conversation_id)

    def conversations_of(self, tenant: str, user: str) -> list[uuid.UUID]:
        """Every conversation with a key whose turn named this user (read to the end)."""
        if not self.catch_up():
            raise self._unavailable()
        with self._lock:
            return sorted(c for c, o in self._owners.items()
                          if o.tenant == tenant and o.user == user and self._of.get(c))

    def owner(self, conversation_id: uuid.UUID) -> Owner | None:
        with self._lock:
            return self._owners.get(conversation_id)

    def destroy(self, *conversations: uuid.UUID, timeout: float = 30.0) -> int:
        """Destroy these conversations' keys now, from this process (``pipeline erase``,
        the projector on a deletion): the number destroyed. Keys destroyed already are
        not written again, so a deletion read twice writes nothing the second time."""
        records = self.tombstones(*conversations)
        if records:
            if self._writer is None:
                self._writer = PlainWriter(self._bootstrap, f"{self._name}-keys")
            for record in records:
                self._writer.send(KEYS, record, None)
            failed = self._writer.flush(timeout)
            if failed:
                raise ProduceError(f"key tombstones not acknowledged: {failed[0]}")
        for conversation in conversations:
            self.forget(conversation)
        return len(records)

    def size(self) -> int:
        with self._lock:
            return len(self._keys)

    # -- reading chat.keys ------------------------------------------------------
    def catch_up(self) -> bool:
        """Wait until the thread has read ``chat.keys`` to its end as it is now; False if
        it could not within the wait."""
        if not self._thread.is_alive():
            return False
        wait = _CatchUp()
        with self._lock:
            self._pending.append(wait)
        return wait.done.wait(self._wait_s) and wait.read

    def _unavailable(self, what: str = "") -> KeyringError:
        """Why a catch-up failed: for good (``_failure``), or for now, Kafka being away
        (``unreachable``: the caller may ask again)."""
        if self._failure is not None:
            return KeyringError(self._failure, unreachable=self._unreachable)
        why = self._missed or f"could not read {KEYS} to its end in {self._wait_s:g} s"
        return KeyringError(f"{why}{': ' if what else ''}{what}", unreachable=True)

    def _follow(self) -> None:
        reader = PlainReader(self._bootstrap, f"{self._name}-keyring")
        try:
            partitions = self._retrying(lambda: reader.partitions(KEYS))
            if not partitions:
                raise KeyringError(f"the topic {KEYS} does not exist: `pipeline topics` "
                                   "makes it")
            reader.start({(KEYS, p): BEGINNING for p in partitions})
            while not self._stop.is_set():
                with self._lock:
                    waiting, self._pending = self._pending, []
                if waiting:
                    read = self._caught_up(reader, partitions)
                    for wait in waiting:
                        wait.read = read
                        wait.done.set()
                else:  # a short wait: a catch-up asked meanwhile starts within it
                    self._apply(reader.read(1000, timeout=POLL_S))
        except KeyringError as exc:
            self._failure = str(exc)
        except Exception as exc:  # the waiters learn it from the failure
            self._failure = f"reading {KEYS} failed: {exc}"
            self._unreachable = unreachable(exc)
            if not self._unreachable:
                log.exception("the keyring stopped following %s", KEYS)
        finally:
            reader.close()
            with self._lock:
                waiting, self._pending = self._pending, []
            for wait in waiting:  # told at once: read is False
                wait.done.set()

    def _caught_up(self, reader: PlainReader, partitions: list[int]) -> bool:
        """Read ``chat.keys`` to its end as it is now: False if Kafka did not let it in
        time (logged; the thread follows on, and the next catch-up tries again)."""
        try:
            self._read_to_end(reader, partitions)
        except (TimeoutError, KafkaException) as exc:
            self._missed = f"could not read {KEYS} to its end: {exc}"
            self._quiet.warning("%s", self._missed)
            return False
        self._missed = None
        return True

    def _retrying(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                return call()
            except Exception:
                if time.monotonic() > deadline or self._stop.is_set():
                    raise
                time.sleep(0.2)

    def _read_to_end(self, reader: PlainReader, partitions: list[int]) -> None:
        # Ask for the partitions' leaders first: ends are asked of them, and a client
        # that followed a broker which lost its leadership learns of its successor here.
        self._retrying(lambda: reader.partitions(KEYS))
        ends = {p: self._retrying(functools.partial(reader.end, KEYS, p)) for p in partitions}
        deadline = time.monotonic() + self._wait_s
        while not self._stop.is_set():
            behind = [p for p, end in ends.items() if end > 0
                      and reader.position(KEYS, p) < end]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{KEYS} partitions {behind} not read to their end")
            self._apply(reader.read(1000, timeout=0.1))

    def _apply(self, records: list[Record]) -> None:
        if not records:
            return
        with self._lock:
            for record in records:
                self._apply_one(record)
            self._applied.notify_all()

    def _apply_one(self, record: Record) -> None:
        try:
            conversation_text, key_id = (record.key or b"").decode().split("/", 1)
            conversation = uuid.UUID(conversation_text)
        except ValueError:
            log.warning("%s holds a record keyed %r: not a data key", KEYS, record.key)
            return
        if record.value is None:  # destroyed
            self._keys.pop(key_id, None)
            self._gone.add(key_id)
            ids = self._of.get(conversation)
            if ids and key_id in ids:
                ids.remove(key_id)
            if not ids:
                self._drop(conversation)
            return
        try:
            data = json.loads(record.value)
            if data["kek"] != self.fingerprint:
                self._failure = (
                    f"{KEYS} holds key {key_id} wrapped by key-encryption key "
                    f"{data['kek']}, and this process has {self.fingerprint}: give every "
                    "process the same PIPELINE_KEK")
                log.error(self._failure)
                return
            raw = base64.b64decode(data["wrapped"])
            secret = self._kek.decrypt(raw[:sealing.NONCE_BYTES], raw[sealing.NONCE_BYTES:],
                                       _aad(conversation, key_id))
            owner = Owner(str(data["tenant"]), data.get("user"))
        except (ValueError, KeyError, TypeError, InvalidTag) as exc:
            log.error("%s record %s is not a data key this process can unwrap: %s",
                      KEYS, record.position, exc)
            return
        self._hold(sealing.DataKey(key_id, conversation, AESGCM(secret)), owner)

    def _hold(self, key: sealing.DataKey, owner: Owner) -> None:
        if key.key_id in self._keys:
            return
        self._keys[key.key_id] = key
        self._of.setdefault(key.conversation_id, []).append(key.key_id)
        self._owners.setdefault(key.conversation_id, owner)
        self._erased.discard(key.conversation_id)

    def _drop(self, conversation: uuid.UUID) -> None:
        for key_id in self._of.pop(conversation, []):
            self._keys.pop(key_id, None)
            self._gone.add(key_id)
        self._owners.pop(conversation, None)
        self._erased.add(conversation)


def _record_key(conversation_id: uuid.UUID, key_id: str) -> bytes:
    return f"{conversation_id}/{key_id}".encode()


def _aad(conversation_id: uuid.UUID, key_id: str) -> bytes:
    return f"{conversation_id}/{key_id}".encode()


def open_keyring(common: CommonSettings, name: str) -> Keyring:
    """This process's keyring, started and installed (see ``Keyring.start``)."""
    return Keyring(common.kafka_bootstrap, load_kek(common), name,
                   erasure_window_s=common.erasure_window_ms / 1000).start()
