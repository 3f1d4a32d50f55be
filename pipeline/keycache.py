"""The data keys a process holds (``pipeline.keystore`` finds the others): a bounded,
thread-safe cache, least recently used first out. It holds ``capacity`` keys, as many
ids of keys known destroyed, and, four times as many, which key seals each
conversation's content next. A key of a conversation erased is never given out."""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable

from pipeline.sealing import DataKey

GONE = object()  # what ``get`` says of a key known destroyed


class KeyCache:
    def __init__(self, capacity: int, revoked: Callable[[uuid.UUID], bool]) -> None:
        self._capacity, self._revoked = capacity, revoked
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, DataKey] = OrderedDict()
        self._current: OrderedDict[uuid.UUID, str] = OrderedDict()  # whose key seals next
        self._gone: OrderedDict[str, None] = OrderedDict()  # looked for, not there

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def __contains__(self, key_id: str) -> bool:
        with self._lock:
            return key_id in self._keys

    def get(self, key_id: str) -> DataKey | object | None:
        """The key if held, ``GONE`` if known destroyed (or its conversation erased since
        it was held), None if not known."""
        with self._lock:
            key = self._keys.get(key_id)
            if key is not None:
                if self._revoked(key.conversation_id):
                    del self._keys[key_id]
                    self._forget(key_id)
                    return GONE
                self._keys.move_to_end(key_id)
                return key
            if key_id in self._gone:
                self._gone.move_to_end(key_id)
                return GONE
        return None

    def current(self, conversation_id: uuid.UUID) -> DataKey | None:
        """The key that seals the conversation's content next, if held."""
        with self._lock:
            key_id = self._current.get(conversation_id)
            key = self._keys.get(key_id) if key_id is not None else None
            if key is not None:
                self._keys.move_to_end(key.key_id)
                self._current.move_to_end(conversation_id)
            return key

    def hold(self, key: DataKey, seals_unless_set: bool = False) -> None:
        """Hold ``key``; if ``seals_unless_set`` and no other key seals its conversation's
        content, it does from now on."""
        with self._lock:
            self._hold(key)
            if seals_unless_set:
                self._current.setdefault(key.conversation_id, key.key_id)
            self._trim()

    def seals(self, key: DataKey) -> None:
        """Hold ``key``: it seals its conversation's content from now on."""
        with self._lock:
            self._hold(key)
            self._current[key.conversation_id] = key.key_id
            self._trim()

    def _hold(self, key: DataKey) -> None:
        self._keys[key.key_id] = key
        self._keys.move_to_end(key.key_id)
        self._gone.pop(key.key_id, None)

    def forget(self, key_id: str) -> None:
        """The key is destroyed: known so, not held."""
        with self._lock:
            self._keys.pop(key_id, None)
            self._forget(key_id)

    def _forget(self, key_id: str) -> None:
        self._gone[key_id] = None
        while len(self._gone) > self._capacity:
            self._gone.popitem(last=False)

    def _trim(self) -> None:
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)
        while len(self._current) > 4 * self._capacity:
            self._current.popitem(last=False)
