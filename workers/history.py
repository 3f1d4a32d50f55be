"""A turn's whole input: its session's history, then its new messages.

A prompt names its history (``schemas.history``); the worker finds it in one of two
places:

* **Kept**: the history after each turn this worker ended, per conversation, in a cache
  bounded by characters (least recently used first out). A session's next turn comes
  to the same worker (its conversation's partition), so nearly every turn finds it.
* **Rebuilt** from the durable record, following the prompt's ``previous`` turn back to
  a first turn, an inline history or a kept one: two records read per turn followed,
  the prompt and its end, in one fetch. A worker that took the partition over, or
  restarted, or let the history go from its cache, does this once per session.

What either gives is checked against the prompt's ``history_digest`` (what the gateway
read the history to be). A kept history that differs is dropped and the history is
rebuilt; a rebuilt one that differs is used (the log is the record; an auditor rebuilds
the same), and the difference is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from pipeline.codec import Codec, DecodeError
from pipeline.kafka import QUICK_ASSIGN, KafkaException, LogReader, Record
from pipeline.retry import Backoff, QuietLog
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import GenerationFailed, GenerationFinished, PromptSubmitted
from schemas.history import BrokenChain, History, base, check_link, digest, rebuild

log = logging.getLogger(__name__)
Position3 = tuple[str, int, int]
ReadAt = Callable[[Sequence[Position3]], Awaitable[dict[Position3, Record | None]]]


class HistoryUnavailable(Exception):
    """The history a prompt names cannot be read: the turn fails with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Kept:
    ref: int  # the prompt offset of the turn this history ends with
    messages: History
    chars: int


@dataclass
class HistoryMetrics:
    kept: Counter
    rebuilt: Counter
    reads: Counter
    mismatches: Counter


class HistoryReader:
    """Records at exact positions, for histories, on a consumer of its own (made at its
    first read); retried while Kafka is away: the turn waits for its history."""

    def __init__(self, bootstrap: str, name: str) -> None:
        self.bootstrap, self.name = bootstrap, name
        self._reader: LogReader | None = None
        self._quiet = QuietLog(log)

    async def __call__(self, wanted: Sequence[Position3]) -> dict[Position3, Record | None]:
        if self._reader is None:
            self._reader = LogReader(self.bootstrap, self.name, "history", **QUICK_ASSIGN)
        backoff = Backoff()
        while True:
            try:
                return await self._reader.read_at(wanted)
            except (KafkaException, TimeoutError) as exc:
                delay = backoff.next()
                self._quiet.warning("could not read a history (retrying in %.1f s): %s",
                                    delay, exc)
                await asyncio.sleep(delay)

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()


class Histories:
    def __init__(self, read_at: ReadAt, codec: Codec, metrics: HistoryMetrics,
                 max_chars: int = 64 * 2**20) -> None:
        self._read_at = read_at
        self._codec = codec  # opens the history's content
        self._metrics = metrics
        self._max_chars = max_chars
        self._kept: OrderedDict[uuid.UUID, _Kept] = OrderedDict()
        self._chars = 0

    @property
    def chars(self) -> int:
        return self._chars

    async def input_for(self, prompt: PromptSubmitted, partition: int) -> History:
        """The model's whole input for ``prompt`` (``HistoryUnavailable`` if its history
        cannot be read)."""
        history = base(prompt)
        if history is None:
            history = self._kept_for(prompt)
            if history is None:
                history = await self._rebuild(prompt, partition)
        elif prompt.history_digest is not None and digest(history) != prompt.history_digest:
            self._mismatch(prompt, "its inline history")
        return history + prompt.messages

    def _kept_for(self, prompt: PromptSubmitted) -> History | None:
        kept = self._kept.get(prompt.conversation_id)
        if kept is None or prompt.previous is None or kept.ref != prompt.previous.prompt:
            return None
        if len(kept.messages) != prompt.history_len or (
                prompt.history_digest is not None
                and digest(kept.messages) != prompt.history_digest):
            log.warning("the history kept for %s is not the one its prompt names; "
                        "rebuilding it from the log", prompt.request_id)
            self._drop(prompt.conversation_id)
            return None
        self._kept.move_to_end(prompt.conversation_id)
        self._metrics.kept.inc()
        return kept.messages

    async def _rebuild(self, prompt: PromptSubmitted, partition: int) -> History:
        turns: list[tuple[PromptSubmitted, GenerationFinished | GenerationFailed]] = []
        start: History | None = None
        later = prompt
        while start is None:
            link = later.previous
            assert link is not None  # base() is None only for a prompt naming its previous
            kept = self._kept.get(prompt.conversation_id)
            if kept is not None and kept.ref == link.prompt and later is not prompt:
                start = kept.messages
                break
            found = await self._read_at([(PROMPTS, partition, link.prompt),
                                         (GENERATIONS, partition, link.end)])
            self._metrics.reads.inc(2)
            previous = await self._event(found[(PROMPTS, partition, link.prompt)], "prompt",
                                    link.prompt)
            end = await self._event(found[(GENERATIONS, partition, link.end)], "end", link.end)
            if not isinstance(previous, PromptSubmitted) or not isinstance(
                    end, (GenerationFinished, GenerationFailed)):
                raise HistoryUnavailable("history_unavailable", "the history's records at "
                                         f"{link.prompt} and {link.end} are not a turn")
            try:
                check_link(later, previous, end)
            except BrokenChain as exc:
                raise HistoryUnavailable("history_unavailable", str(exc)) from None
            turns.append((previous, end))
            later = previous
            start = base(previous)
        history = rebuild(start, turns[::-1])
        self._metrics.rebuilt.inc()
        if len(history) != prompt.history_len or (
                prompt.history_digest is not None and digest(history) != prompt.history_digest):
            self._mismatch(prompt, f"the {len(history)} messages rebuilt from the log")
        return history

    def _mismatch(self, prompt: PromptSubmitted, what: str) -> None:
        self._metrics.mismatches.inc()
        log.error("the history of %s is not what its prompt says (%d messages, digest %s): "
                  "running it on %s", prompt.request_id, prompt.history_len,
                  prompt.history_digest, what)

    def remember(self, conversation: uuid.UUID, ref: int, history: History) -> None:
        """``history`` is the session's after its turn whose prompt is at ``ref``."""
        self._drop(conversation)
        chars = sum(len(m.content) for m in history)
        if chars > self._max_chars // 4:
            return  # one session alone may not push out every other
        self._kept[conversation] = _Kept(ref, history, chars)
        self._chars += chars
        while self._chars > self._max_chars:
            self._drop(next(iter(self._kept)))

    def forget(self, conversation: uuid.UUID) -> None:
        """Let the conversation's history go (its session was deleted)."""
        self._drop(conversation)

    def _drop(self, conversation: uuid.UUID) -> None:
        kept = self._kept.pop(conversation, None)
        if kept is not None:
            self._chars -= kept.chars

    async def _event(self, record: Record | None, what: str, offset: int) -> object:
        if record is None:
            raise HistoryUnavailable("history_unavailable", f"the history's {what} at "
                                     f"offset {offset} is not in the log (past the "
                                     "topic's retention?)")
        try:
            return await self._codec.decode_async(record.value)
        except DecodeError as exc:
            raise HistoryUnavailable("history_unavailable",
                                     f"the history's {what} at offset {offset}: {exc}"
                                     ) from None
