"""``pipeline bench sealing``: what sealing content with its conversation's data key costs
in CPU per token, in process (no Kafka: the keys are held in memory, as a keyring
holds them once it has read ``chat.keys``).

Each case is timed sealed and in the clear, alternating, and the medians of the rounds
are set side by side:

* **live, one delta per turn**: a ``chat.live`` record of 256 running turns with one
  delta of 4 characters each (a loaded GPU's step: every turn sealed alone, the worst
  case per token); written by the worker's output, then read by the codec.
* **live, 8 deltas per turn**: 32 turns with 8 deltas each in a record (a worker's
  window at 8 tokens a turn).
* **a turn's end**: a ``GenerationFinished`` of 256 tokens (1 KB of text), encoded and
  decoded.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pipeline import sealing
from pipeline.codec import CLEAR, Codec
from pipeline.kafka import Outgoing
from schemas import GenerationFinished, Usage


class MemoryRing:
    """Keys held in memory: one per conversation."""

    def __init__(self) -> None:
        self.keys: dict[uuid.UUID, sealing.DataKey] = {}
        self.by_id: dict[str, sealing.DataKey] = {}

    def add(self, conversation: uuid.UUID) -> None:
        key, _ = sealing.new_data_key(conversation)
        self.keys[conversation] = key
        self.by_id[key.key_id] = key

    def for_writing(self, conversation_id: uuid.UUID
                    ) -> sealing.DataKey | Literal["erased"] | None:
        return self.keys.get(conversation_id)

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        return self.by_id.get(key_id)

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        return False


class DroppingWriter:
    """The writer's side a worker's output uses: records are counted and dropped, the
    last ones handed to it kept until the next."""

    epoch = 0

    def __init__(self) -> None:
        self.records = 0
        self.last: list[Outgoing] = []

    def limit(self, topic: str) -> int:
        return 1_000_000

    def send_together(self, records: list[Outgoing], epoch: int = 0) -> list[None]:
        self.records += len(records)
        self.last = records
        return [None] * len(records)

    def gathered(self) -> None:
        pass

    def begins_in(self) -> float | None:
        return 0.0  # takes each step's records at once


def _live_case(turns: int, per_turn: int, codec: Codec, ring: MemoryRing) -> Callable[[], int]:
    from workers.output import Output

    writer = DroppingWriter()
    output = Output(writer, "bench", codec)  # type: ignore[arg-type]  # live records alone
    conversations = [uuid.uuid4() for _ in range(turns)]
    for c in conversations:
        ring.add(c)
    for ref, c in enumerate(conversations):
        output._seals[(0, ref)] = (c, ring.keys[c])
    deltas: list[tuple[int, int, str, tuple[int, ...]]] = [
        (ref, seq, "tok ", (1234,)) for seq in range(per_turn) for ref in range(turns)]

    def run() -> int:
        for ref, seq, text, token_ids in deltas:
            output.delta(0, ref, seq, text, token_ids, 0)
        output.flush(0)  # the record made: the worker's own
        codec.decode_live(writer.last[0].value)
        return len(deltas)

    return run


def _end_case(tokens: int, codec: Codec, ring: MemoryRing) -> Callable[[], int]:
    conversation = uuid.uuid4()
    ring.add(conversation)
    end = GenerationFinished(conversation_id=conversation, request_id="r", model="m",
                             reply_seq=1, finish_reason="stop", text="tok " * tokens,
                             usage=Usage(prompt_tokens=10, completion_tokens=tokens),
                             deltas=tokens, duration_ms=1.0)

    def run() -> int:
        codec.decode(codec.encode(end))
        return tokens

    return run


# Each case, made with a codec (sealing through the ring, or ``CLEAR``) and the ring.
CASES: dict[str, Callable[[Codec, MemoryRing], Callable[[], int]]] = {
    "live, one delta per turn (256 turns)": lambda c, ring: _live_case(256, 1, c, ring),
    "live, 8 deltas per turn (32 turns)": lambda c, ring: _live_case(32, 8, c, ring),
    "a turn's end (256 tokens)": lambda c, ring: _end_case(256, c, ring),
}


def _per_token(run: Callable[[], int], seconds: float) -> float:
    tokens, start = 0, time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        tokens += run()
    return (time.perf_counter() - start) / tokens * 1e6


def run(quick: bool) -> dict[str, Any]:
    rounds, seconds = (3, 0.3) if quick else (9, 1.0)
    figures: dict[str, Any] = {"rounds": rounds, "cases": {}}
    for name, make in CASES.items():
        ring = MemoryRing()
        sealing_case = make(Codec(sealing.Cipher(ring)), ring)
        clear_case = make(CLEAR, ring)
        clear, sealed = [], []
        for _ in range(rounds):
            sealed.append(_per_token(sealing_case, seconds))
            clear.append(_per_token(clear_case, seconds))
        figures["cases"][name] = {
            "clear_us_per_token": statistics.median(clear),
            "sealed_us_per_token": statistics.median(sealed),
            "added_us_per_token": statistics.median(s - c for s, c in
                                                    zip(sealed, clear, strict=True))}
    return figures


def table(figures: dict[str, Any]) -> str:
    lines = ["| case | in the clear, µs per token | sealed, µs per token | added |",
             "|---|---:|---:|---:|"]
    for name, f in figures["cases"].items():
        lines.append(f"| {name} | {f['clear_us_per_token']:.2f} | "
                     f"{f['sealed_us_per_token']:.2f} | {f['added_us_per_token']:+.2f} |")
    return "\n".join(lines)
