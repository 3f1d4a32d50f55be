"""Sealing content with data keys, without Kafka: keys held in memory as a keyring holds
them, and a key's record as chat.keys keeps it (the keyring itself, on a real broker:
``test_erasure.py``)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
import zlib
from pathlib import Path
from typing import Literal

import pytest

from pipeline import sealing
from pipeline.codec import CLEAR, Codec, DecodeError, Position, bare, parse_live, sealed_key
from pipeline.kafka import Record
from pipeline.kek import Kek, KekError, KeyRef, key_info
from pipeline.topics import KEYS
from projections.keys import key_writes
from schemas import (
    ChatMessage,
    GenerationFinished,
    PromptSubmitted,
    Recalled,
    SessionCreated,
    Usage,
)
from schemas.history import recall
from workers.output import Output


class Ring:
    def __init__(self) -> None:
        self.keys: dict[uuid.UUID, sealing.DataKey] = {}
        self.erased: set[uuid.UUID] = set()

    def add(self, conversation: uuid.UUID) -> sealing.DataKey:
        self.keys[conversation], _ = sealing.new_data_key(conversation)
        return self.keys[conversation]

    def for_writing(self, conversation_id: uuid.UUID
                    ) -> sealing.DataKey | Literal["erased"] | None:
        if conversation_id in self.erased:
            return "erased"
        return self.keys.get(conversation_id)

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        return next((k for k in self.keys.values() if k.key_id == key_id), None)

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        return conversation_id in self.erased

    def destroy(self, conversation: uuid.UUID) -> None:
        del self.keys[conversation]
        self.erased.add(conversation)


@pytest.fixture
def ring() -> Ring:
    return Ring()


@pytest.fixture
def codec(ring: Ring) -> Codec:
    return Codec(sealing.Cipher(ring))


def prompt(conversation: uuid.UUID, text: str) -> PromptSubmitted:
    return PromptSubmitted(
        conversation_id=conversation, request_id="r1", model="m", history_len=1,
        history=(ChatMessage(role="user", content=f"before {text}"),),
        messages=(ChatMessage(role="user", content=text),))


def test_content_is_sealed_and_opens_to_the_same_event(ring: Ring, codec: Codec) -> None:
    conversation = uuid.uuid4()
    ring.add(conversation)
    long_reply = "a reply long enough to be deflated before it is sealed " * 20
    events = [prompt(conversation, "secret words"),
              SessionCreated(conversation_id=conversation, request_id="s", title="secret title"),
              GenerationFinished(conversation_id=conversation, request_id="r1", model="m",
                                 reply_seq=2, finish_reason="stop", text=long_reply,
                                 usage=Usage(prompt_tokens=1, completion_tokens=2), deltas=2,
                                 duration_ms=1.0)]
    for event in events:
        raw = codec.encode(event)
        assert b"secret" not in raw and b"deflated" not in raw
        assert json.loads(raw)["sealed"]["key"] == ring.keys[conversation].key_id
        assert codec.decode(raw) == event
    # Deflated before sealing: the box is smaller than the text it holds.
    assert len(codec.encode(events[2])) < len(long_reply)


def test_recalled_memories_are_sealed_with_the_turn_and_erased_with_it(
        ring: Ring, codec: Codec) -> None:
    conversation = uuid.uuid4()
    ring.add(conversation)
    event = prompt(conversation, "question").model_copy(update={
        "memory": True, "user": "alice",
        "recalled": (Recalled(id="chatcmpl-1", text="secret fact"),
                     Recalled(id="chatcmpl-2", text="secret too"))})
    raw = codec.encode(event)
    assert b"secret" not in raw and b"chatcmpl-1" in raw  # which memories: in the clear
    assert codec.decode(raw) == event
    # What the model is given: one system message before the session, from the event.
    [given] = recall(codec.decode(raw).recalled)  # type: ignore[union-attr]
    assert given.role == "system" and "- secret fact\n- secret too" in given.content
    ring.destroy(conversation)
    erased = codec.decode(raw)
    assert isinstance(erased, PromptSubmitted) and erased.erased
    assert [r.text for r in erased.recalled] == ["", ""]
    assert [r.id for r in erased.recalled] == ["chatcmpl-1", "chatcmpl-2"]
    # A turn with memory names its user.
    with pytest.raises(ValueError, match="names its user"):
        PromptSubmitted.model_validate({**event.model_dump(), "user": None})


def test_without_the_key_content_reads_as_erased_and_nothing_else_changes(
        ring: Ring, codec: Codec) -> None:
    conversation = uuid.uuid4()
    ring.add(conversation)
    event = prompt(conversation, "secret words")
    raw = codec.encode(event)
    ring.destroy(conversation)
    erased = codec.decode(raw)
    assert isinstance(erased, PromptSubmitted) and erased.erased
    assert [m.content for m in (*erased.messages, *(erased.history or ()))] == ["", ""]
    assert erased.model_dump(exclude={"messages", "history", "sealed"}) == \
        event.model_dump(exclude={"messages", "history", "sealed"})
    # Re-encoded (an audit, a dead letter), it stays as it was: nothing to open.
    assert codec.decode(codec.encode(erased)) == erased
    # Written after its keys were destroyed: the content is dropped, not written clear.
    late = codec.encode(prompt(conversation, "written late"))
    assert b"written late" not in late and codec.decode(late).erased


def test_a_box_moved_to_another_conversation_or_altered_does_not_open(
        ring: Ring, codec: Codec) -> None:
    mine, theirs = uuid.uuid4(), uuid.uuid4()
    ring.add(mine)
    ring.add(theirs)
    data = json.loads(codec.encode(prompt(mine, "secret words")))
    moved = {**data, "conversation_id": str(theirs)}
    with pytest.raises(DecodeError, match="another conversation"):
        codec.decode(json.dumps(moved).encode())
    box = data["sealed"]["box"]
    altered = {**data, "sealed": {**data["sealed"], "box": box[:-8] + "AAAAAAA="}}
    with pytest.raises(DecodeError, match="does not open"):
        codec.decode(json.dumps(altered).encode())


def test_the_key_a_record_names_is_read_without_decoding_it(ring: Ring, codec: Codec) -> None:
    """What a worker reads of each polled prompt to fetch their keys together: the key
    its box names and when it was written; nothing for content in the clear, a record
    that is no event, or one whose fields are not what an event's are."""
    conversation = uuid.uuid4()
    key = ring.add(conversation)
    event = prompt(conversation, "sealed")
    assert sealed_key(codec.encode(event)) == (key.key_id, event.occurred_at.timestamp())
    assert sealed_key(CLEAR.encode(event)) is None
    for hostile in (None, b"", b"[]", b"\x00", b'{"sealed": 5}', b'{"sealed": {"box": "x"}}',
                    b'{"sealed": {"key": "k"}, "occurred_at": "yesterday"}', b"{" * 10_000):
        assert sealed_key(hostile) is None, hostile
    # A worker asks for its own model's prompts' keys alone.
    assert sealed_key(codec.encode(event), "m") == (key.key_id, event.occurred_at.timestamp())
    assert sealed_key(codec.encode(event), "another model") is None
    assert sealed_key(b'{"sealed": {"key": "k"}, "model": 5}', "m") is None


def test_content_a_reader_does_not_want_stays_sealed_and_no_key_is_asked_for(
        ring: Ring, codec: Codec) -> None:
    """A worker opens only the prompts of its model: another model's comes back as
    ``parse`` gives it (sealed, content empty), and its key is not asked for, so a key
    that cannot be read stalls only the workers that run the prompt."""
    conversation = uuid.uuid4()
    key = ring.add(conversation)
    raw = codec.encode(prompt(conversation, "not mine"))
    asked: list[str] = []
    looking = ring.for_reading

    def for_reading(key_id: str, *args: object, **kwargs: object) -> sealing.DataKey | None:
        asked.append(key_id)
        return looking(key_id)

    ring.for_reading = for_reading  # type: ignore[method-assign]
    event, opened_with = codec.decode_keyed(
        raw, lambda e: isinstance(e, PromptSubmitted) and e.model == "x")
    assert asked == [] and opened_with is None
    assert event.sealed is not None and event.sealed.key == key.key_id
    assert isinstance(event, PromptSubmitted)
    assert [m.content for m in event.messages] == [""]  # the text stays in its box
    event, opened_with = asyncio.run(codec.decode_keyed_async(raw, lambda e: True))
    assert asked == [key.key_id] and opened_with == key
    assert isinstance(event, PromptSubmitted) and event.messages[0].content == "not mine"


def test_a_conversation_without_keys_is_written_in_the_clear(ring: Ring, codec: Codec) -> None:
    raw = codec.encode(prompt(uuid.uuid4(), "legacy words"))
    assert b"legacy words" in raw and b"sealed" not in raw


def test_a_codec_seals_with_its_own_cipher_alone(ring: Ring, codec: Codec) -> None:
    """The cipher is given to each codec: no keyring is the process's. Two readers in one
    process (an auditor of two clusters, a service and its tests) each open what their
    own keys open; and no producer writes content in the clear unless its writer's codec
    says so."""
    conversation = uuid.uuid4()
    ring.add(conversation)
    written = prompt(conversation, "secret words")
    raw = codec.encode(written)
    assert codec.decode(raw) == written
    assert CLEAR.decode(raw).erased  # one holding no keys reads it as erased
    other = Ring()
    assert Codec(sealing.Cipher(other)).decode(raw).erased
    other.keys[conversation] = ring.keys[conversation]
    assert Codec(sealing.Cipher(other)).decode(raw) == written
    # A producer's ``send`` encodes bare: content must come through a codec.
    with pytest.raises(ValueError, match="carries content"):
        bare(written)
    assert bare(CLEAR.decode(raw)) == raw  # sealed already: as it was
    assert b"secret words" in CLEAR.encode(written)  # in the clear, as asked


def test_the_live_stream_seals_each_turn_with_its_own_key(ring: Ring, codec: Codec) -> None:
    a, b, clear = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    ring.add(a)
    ring.add(b)
    class Limits:  # what Output reads of its writer when only batches are made
        def limit(self, topic: str) -> int:
            return 1_000_000

    output = Output(Limits(), "w", codec)  # type: ignore[arg-type]
    output._seals.update({(0, 10): (a, ring.keys[a]), (0, 11): (b, ring.keys[b]),
                          (0, 12): (clear, None)})
    for ref, seq, text, ids in [(10, 0, "alpha ", (1,)), (11, 0, "beta ", (2,)),
                                (10, 1, "gamma", (3,)), (12, 0, "open", (4,))]:
        output.delta(0, ref, seq, text, ids, 0)
    batch = output._open.pop(0)
    kept, boxes = batch.deltas, output._sealed(0, batch.texts)
    assert [d[2] for d in kept] == ["", "", "", "open"]
    assert sorted(ref for ref, _, _ in boxes) == [10, 11]
    value = json.dumps({"type": "LiveBatch", "worker": "w", "at": 0, "deltas": kept,
                        "sealed": boxes}).encode()
    assert b"alpha" not in value and b"beta" not in value
    assert [(d[2], d[3]) for d in codec.decode_live(value).deltas] == [
        ("alpha ", (1,)), ("beta ", (2,)), ("gamma", (3,)), ("open", (4,))]
    # A reader opens only the turns it wants; one without a turn's key gets it empty.
    only_b = codec.open_live(parse_live(value), {11})
    assert [d[2] for d in only_b.deltas] == ["", "beta ", "", "open"]
    ring.destroy(a)
    assert [d[2] for d in codec.decode_live(value).deltas] == ["", "beta ", "", "open"]
    # Written after its keys were destroyed: the turn's text is not written at all.
    output.delta(0, 10, 2, "late", (5,), 0)
    batch = output._open.pop(0)
    assert batch.deltas == [(10, 2, "", ())]
    assert output._sealed(0, batch.texts) == [(10, sealing.ERASED, "")]


def test_a_box_that_would_open_past_the_bound_is_unreadable() -> None:
    key, _ = sealing.new_data_key(uuid.uuid4())
    # Made as a hostile producer would: this code deflates no payload that large.
    packed = b"\x01" + zlib.compress(b"\0" * (sealing.MAX_OPENED + 1), 1)
    nonce = b"\0" * sealing.NONCE_BYTES
    bomb = base64.b64encode(nonce + key.aead.encrypt(nonce, packed, key.key_id.encode())
                            ).decode()
    assert len(bomb) < 1_000_000  # a record the log takes
    with pytest.raises(sealing.Unreadable, match="more than"):
        sealing.unseal(key, bomb)
    assert sealing.unseal(key, sealing.seal(key, b"\0" * 1000)) == b"\0" * 1000


def test_nonces_never_repeat_within_a_process() -> None:
    key, _ = sealing.new_data_key(uuid.uuid4())
    boxes = {sealing.seal(key, b"same") for _ in range(10_000)}
    assert len(boxes) == 10_000
    assert len({box[:16] for box in boxes}) == 10_000  # the nonce leads each box


class SlowRing(Ring):
    """A ring that holds its keys only once it has looked for them, which takes
    ``LOOKUP_S`` (a read of the key topic while Kafka is slow)."""

    LOOKUP_S = 0.3

    def __init__(self) -> None:
        super().__init__()
        self.followed: set[str] = set()
        self.lookups: list[str] = []

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        if key_id not in self.followed:
            if not wait:
                raise sealing.KeyNotHeld(key_id)
            self.lookups.append(key_id)
            time.sleep(self.LOOKUP_S)
            self.followed.add(key_id)
        return super().for_reading(key_id)


def test_a_key_not_held_yet_is_looked_for_off_the_event_loop() -> None:
    slow, other = SlowRing(), Ring()
    conversation = uuid.uuid4()
    slow.add(conversation)
    codec = Codec(sealing.Cipher(slow, other))  # slow asked first
    written = prompt(conversation, "secret words")
    raw = codec.encode(written)

    async def read() -> tuple[object, int]:
        with pytest.raises(sealing.KeyNotHeld):  # on the loop: never a wait
            codec.decode(raw)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        event = await codec.decode_async(raw)
        ticker.cancel()
        return event, ticks

    event, ticks = asyncio.run(read())
    # The loop's other tasks went on while the key was looked for.
    assert event == written
    assert ticks >= 10 and slow.lookups == [slow.keys[conversation].key_id]
    # A ring asked later (another cluster's) that holds a key answers before the first
    # looks for it.
    second = uuid.uuid4()
    other.add(second)
    other_prompt = prompt(second, "other words")
    assert codec.decode(codec.encode(other_prompt)) == other_prompt
    assert len(slow.lookups) == 1


class ForgetfulRing(Ring):
    """Holds nothing it looked up: as a bounded cache does when other look-ups, or keys
    read ahead, push a key out between its look-up and its use."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        if not wait:
            raise sealing.KeyNotHeld(key_id)
        self.lookups += 1
        return super().for_reading(key_id)


def test_a_key_looked_up_opens_the_record_that_asked_whatever_the_cache_let_go() -> None:
    """A decode that met a key not held looks it up on a thread, then runs again: it
    uses the key looked up, not the cache (a small cache reading ahead let it go at
    once, and the decode asked for it again, for ever)."""
    forgetful = ForgetfulRing()
    conversation = uuid.uuid4()
    forgetful.add(conversation)
    codec = Codec(sealing.Cipher(forgetful))
    written = prompt(conversation, "kept words")
    raw = codec.encode(written)
    event = asyncio.run(asyncio.wait_for(codec.decode_async(raw), 10))
    assert event == written and forgetful.lookups == 1
    # Looked up for that record alone: the next one looks again.
    assert asyncio.run(asyncio.wait_for(codec.decode_async(raw), 10)) == written
    assert forgetful.lookups == 2


def test_a_key_reference_names_its_place_and_a_short_id_alone_is_a_legacy_one() -> None:
    ref = KeyRef("0123456789abcdef", 4, 918273)
    assert KeyRef.parse(str(ref)) == ref
    for legacy in ("0123456789abcdef", "a.b.c", "x.1", "a.-1.2", "a.1.2.3", ""):
        assert KeyRef.parse(legacy) is None, legacy
    # A place no topic has (a hostile box's): the Kafka client raised OverflowError on
    # it, which stopped the worker that looked it up, and it names no short id either.
    assert KeyRef.parse(f"a.{2**31 - 1}.{2**63 - 1}") == KeyRef("a", 2**31 - 1, 2**63 - 1)
    for far in (f"a.{2**31}.0", f"a.0.{2**63}", "a.0.99999999999999999999999"):
        assert KeyRef.parse(far) is None, far


def test_a_wrapped_key_opens_only_where_it_was_wrapped_and_with_its_kek() -> None:
    kek = Kek(os.urandom(32))
    conversation = uuid.uuid4()
    key, secret = sealing.new_data_key(conversation)
    value = kek.wrap(conversation, key.key_id, secret, "t", "alice")
    record = f"{conversation}/{key.key_id}".encode()
    opened = kek.unwrap(record, value, "ref")
    box = sealing.seal(key, b"words")
    assert sealing.unseal(sealing.DataKey(key.key_id, conversation, opened.aead), box) == \
        b"words"
    with pytest.raises(ValueError):  # moved to another conversation: the AAD differs
        kek.unwrap(f"{uuid.uuid4()}/{key.key_id}".encode(), value, "ref")
    with pytest.raises(KekError):  # another KEK wrapped it
        Kek(os.urandom(32)).unwrap(record, value, "ref")
    info = key_info(record, value)
    assert (info.conversation_id, info.tenant, info.user_digest, info.placed) == (
        conversation, "t", "alice", True)


@pytest.mark.parametrize("value", [
    b"[]", b"null", b'"text"', b"{}", b'{"tenant": 5}', b'{"tenant": "t", "user_digest": []}',
    b'{"tenant": "t", "at": "soon"}', b"\xff\xfe",
    b'{"tenant": "t", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_key_record_that_is_not_one_is_refused_for_the_dead_letters(value: bytes) -> None:
    record = Record(Position(KEYS, 0, 7), f"{uuid.uuid4()}/abc".encode(), value, 0)
    with pytest.raises(ValueError):
        key_writes(record)


def test_a_key_made_at_a_time_no_clock_gives_is_refused_not_crashed() -> None:
    value = json.dumps({"tenant": "t", "at": 10**30}).encode()
    with pytest.raises(ValueError):
        key_writes(Record(Position(KEYS, 0, 7), f"{uuid.uuid4()}/abc".encode(), value, 0))
    assert key_writes(Record(Position(KEYS, 2, 9), f"{uuid.uuid4()}/abc".encode(), None, 0))


def test_processes_of_a_new_stack_starting_at_once_share_one_kek(tmp_path: Path) -> None:
    """The first process of a local stack makes its KEK file; others starting at once
    read the whole key, never a file begun (four at once read an empty one in 87 rounds
    of 200, and stopped), and nothing is left beside it."""
    from pipeline.kek import load_kek
    from pipeline.settings import CommonSettings
    from tests.conftest import at_once

    for n in range(50):
        common = CommonSettings(state_dir=tmp_path / str(n))
        got: list[bytes] = []
        assert at_once(lambda c=common, g=got: g.append(load_kek(c)), 4) == []
        assert len(got) == 4 and len(set(got)) == 1
        assert [p.name for p in (tmp_path / str(n)).iterdir()] == ["kek"]
