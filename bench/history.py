"""A year of state, built in minutes: N finished conversations written through the
project's own writers, as gateways and workers write them. For ``pipeline bench scale``.

Each conversation has what a session with one finished turn leaves in the log:

* its data key in ``chat.keys`` (``Keyring.new_key``, wrapped by the KEK), in its
  conversation's partition;
* its ``SessionCreated`` with a sealed title in ``chat.control``;
* its ``PromptSubmitted`` (sealed messages) in ``chat.prompts``;
* its ``GenerationStarted`` and ``GenerationFinished`` (sealed reply) in
  ``chat.generations``;
* its live record (start, deltas, end; sealed text, as ``workers.output`` seals it) in
  ``chat.live``.

The records of each partition are written by one process, so each record's offset is
known as it is written: a key's reference and a turn's reference (its prompt's offset)
are named without waiting for an acknowledgement. The writer checks the ends afterwards.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline import sealing
from pipeline.codec import CLEAR, conversation_key
from pipeline.digests import Digester
from pipeline.kafka import ProduceError
from pipeline.kafka.plain import PlainWriter
from pipeline.kek import Kek, KeyRef
from pipeline.partitioning import partition_for
from pipeline.topics import CONTROL, GENERATIONS, KEYS, LIVE, PROMPTS
from schemas import (
    ChatMessage,
    EventIds,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SamplingParams,
    SessionCreated,
    Usage,
)

USERS = 100_000
REPLY = "the reply to a question of a year ago, in sixty-four tokens or so; " * 4
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Written:
    """One conversation the history holds (a sample of them is kept for the readings)."""

    conversation_id: uuid.UUID
    tenant: str
    partition: int
    prompt_offset: int
    request_id: str


def build(bootstrap: str, kek: bytes, conversations: int, partitions: int,
          processes: int = 2, sample: int = 2000,
          progress: Any = None) -> list[Written]:
    """Write ``conversations`` (see the module) from ``processes`` processes, each owning
    some partitions; ``progress(n)`` is called as they go. A sample of what was written."""
    owned = [[p for p in range(partitions) if p % processes == i] for i in range(processes)]
    shares = [conversations * len(parts) // partitions for parts in owned]
    shares[-1] += conversations - sum(shares)
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    results = context.Queue()
    procs = [context.Process(target=_write_share, args=(
        bootstrap, kek, parts, share, partitions, sample // processes, counter, results))
        for parts, share in zip(owned, shares, strict=True)]
    for proc in procs:
        proc.start()
    out: list[Written] = []
    got = 0
    while got < len(procs):
        try:
            kept = results.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a writer of the history failed: see its traceback") \
                    from None
        else:
            if isinstance(kept, BaseException):
                raise RuntimeError("a writer of the history failed") from kept
            out += kept
            got += 1
        if progress is not None:
            progress(counter.value)
    for proc in procs:
        proc.join()
    return out


def _write_share(bootstrap: str, kek_bytes: bytes, owned: list[int], count: int,
                 partitions: int, sample: int, counter: Any, results: Any) -> None:
    try:
        results.put(_write(bootstrap, kek_bytes, owned, count, partitions, sample, counter))
    except BaseException as exc:
        results.put(RuntimeError(repr(exc)))
        raise


def _write(bootstrap: str, kek_bytes: bytes, owned: list[int], count: int,
           partitions: int, sample: int, counter: Any) -> list[Written]:
    kek, digests = Kek(kek_bytes), Digester(kek_bytes)
    producer = PlainWriter(bootstrap, "history", linger_ms=50, compression="zstd")
    offsets = {(t, p): 0 for t in (KEYS, CONTROL, PROMPTS, GENERATIONS, LIVE) for p in owned}
    kept: list[Written] = []
    every = max(count // max(sample, 1), 1)
    done = 0
    while done < count:
        conversation = uuid.uuid4()
        partition = partition_for(conversation_key(conversation), partitions)
        if partition not in owned:
            continue
        n = done
        written = _one(producer, kek, digests, conversation, partition, n, offsets)
        if n % every == 0:
            kept.append(written)
        done += 1
        if done % 1000 == 0:
            producer.poll()
            with counter.get_lock():
                counter.value += 1000
    failed = producer.flush(300)
    if failed:
        raise RuntimeError(f"the history's records were not all acknowledged: {failed[0]}")
    with counter.get_lock():
        counter.value += done % 1000
    return kept


def _produce(producer: PlainWriter, topic: str, partition: int, key: bytes | None,
             value: bytes, offsets: dict[tuple[str, int], int]) -> int:
    while True:
        try:
            producer.send(topic, key, value, partition)
            break
        except ProduceError:  # its queue is full: let deliveries make room
            producer.poll(0.05)
    offset = offsets[(topic, partition)]
    offsets[(topic, partition)] = offset + 1
    return offset


def _one(producer: PlainWriter, kek: Kek, digests: Digester, conversation: uuid.UUID,
         partition: int, n: int,
         offsets: dict[tuple[str, int], int]) -> Written:
    tenant = "default"
    data_key, secret = sealing.new_data_key(conversation)
    record_key = f"{conversation}/{data_key.key_id}".encode()
    at = offsets[(KEYS, partition)]
    _produce(producer, KEYS, partition, record_key,
             kek.wrap(conversation, data_key.key_id, secret, tenant,
                       digests.digest("user", tenant, f"user-{n % USERS}")),
             offsets)
    key = sealing.DataKey(str(KeyRef(data_key.key_id, partition, at)), conversation,
                          data_key.aead)
    ckey = conversation_key(conversation)
    request_id = f"chatcmpl-{conversation.hex}{n:016x}"[:64]
    session = SessionCreated(conversation_id=conversation, request_id=f"session-{n}",
                             tenant=tenant, title=f"conversation {n}")
    _produce(producer, CONTROL, partition, ckey, CLEAR.encode(session, key), offsets)
    prompt = PromptSubmitted(
        conversation_id=conversation, request_id=request_id, tenant=tenant, model="sim",
        messages=(ChatMessage(role="user", content=f"question {n}: what happened "
                              "a year ago, in a sentence or two?"),),
        sampling=SamplingParams(max_tokens=64))
    ref = _produce(producer, PROMPTS, partition, ckey, CLEAR.encode(prompt, key), offsets)
    ids = EventIds(conversation_id=conversation, request_id=request_id, tenant=tenant)
    started = GenerationStarted(**ids, ref=ref, model="sim", worker="history",
                                reply_seq=1, prompt_tokens=24)
    _produce(producer, GENERATIONS, partition, ckey, CLEAR.encode(started, key), offsets)
    finished = GenerationFinished(**ids, ref=ref, model="sim", reply_seq=1,
                                  finish_reason="length", text=REPLY,
                                  usage=Usage(prompt_tokens=24, completion_tokens=64),
                                  deltas=4, duration_ms=800.0)
    _produce(producer, GENERATIONS, partition, ckey, CLEAR.encode(finished, key), offsets)
    quarter = len(REPLY) // 4
    texts = [(REPLY[i * quarter:(i + 1) * quarter], ()) for i in range(4)]
    box = sealing.seal(key, _encoder.encode(texts))
    live = _encoder.encode({
        "type": "LiveBatch", "v": 1, "worker": "history", "at": int(time.time() * 1000),
        "starts": [(ref, 0, request_id)],
        "deltas": [(ref, seq, "", ()) for seq in range(4)],
        "ends": [(ref, 4, "length", 24, 64)], "failures": [],
        "sealed": [(ref, key.key_id, box)]})
    _produce(producer, LIVE, partition, None, live, offsets)
    return Written(conversation, tenant, partition, ref, request_id)
