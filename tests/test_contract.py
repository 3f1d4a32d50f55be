"""The published event contract (docs/contract/) matches the code, is self-consistent,
and real events validate against it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import typing
import uuid
from typing import Any

import jsonschema
import yaml

from pipeline import contract, sealing
from pipeline.codec import CLEAR, Codec
from pipeline.contract import event_schema
from pipeline.settings import REPO_ROOT
from pipeline.topics import CONVERSATION_TOPICS, LIVE
from schemas import (
    ChatMessage,
    ClientDetached,
    Event,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    Recalled,
    SamplingParams,
    SessionCreated,
    TokenDelta,
    TurnRef,
    Usage,
)
from schemas.content import FIELD_CLASSES

# Every event type the log may hold.
EVENT_TYPES = typing.get_args(typing.get_args(Event)[0])


def test_checked_in_contract_matches_the_code() -> None:
    assert contract.stale(REPO_ROOT) == [], "run `pipeline contract` and commit docs/contract"
    check = subprocess.run([sys.executable, "-m", "launch", "contract", "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def test_real_events_validate_against_the_json_schema() -> None:
    schema = json.loads((REPO_ROOT / contract.CONTRACT_DIR / contract.SCHEMA_FILE).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    ids: dict[str, Any] = {"conversation_id": uuid.uuid4(), "request_id": "r1", "tenant": "t"}
    events = [
        PromptSubmitted(**ids, model="m", messages=(ChatMessage(role="user", content="hi"),)),
        PromptSubmitted(**ids, model="m", messages=(ChatMessage(role="user", content="hi"),),
                        history_len=2, previous=TurnRef(prompt=4, end=9),
                        history_digest="ab" * 32),
        ClientDetached(**ids, attachment="a", grace_s=1.5),
        GenerationStarted(**ids, model="m", worker="w", reply_seq=1, prompt_tokens=3),
        TokenDelta(**ids, seq=0, text="he\x00llo", token_ids=(1, 2)),
        GenerationFinished(**ids, model="m", reply_seq=1, finish_reason="stop", text="hello",
                           usage=Usage(prompt_tokens=3, completion_tokens=2), deltas=1,
                           ttft_ms=1.0, duration_ms=2.0),
        GenerationFailed(**ids, code="engine_dead", message="gone"),
    ]
    for event in events:
        validator.validate(json.loads(CLEAR.encode(event)))
    # And it refuses what the code refuses.
    bad = json.loads(CLEAR.encode(events[4]))
    bad["seq"] = -1
    assert not validator.is_valid(bad)
    assert not validator.is_valid({**json.loads(CLEAR.encode(events[0])), "type": "Nope"})


def test_live_records_the_worker_writes_validate_against_the_live_schema() -> None:
    """What ``workers.output`` writes (``schemas.live.write_batch``, not pydantic) is what the
    published schema describes, and what the schema refuses the code refuses too."""
    import asyncio

    from pipeline.codec import DecodeError
    from workers.output import Output

    schema = json.loads((REPO_ROOT / contract.CONTRACT_DIR / contract.LIVE_SCHEMA_FILE)
                        .read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)

    class Recorder:  # what Output hands its writer, kept
        def __init__(self) -> None:
            self.values: list[bytes] = []

        def limit(self, topic: str) -> int:
            return 1_000_000

        def send_together(self, records: list[Any], epoch: int) -> list[None]:
            self.values += [r.value for r in records if r.topic == LIVE]
            return [None] * len(records)

    ids: dict[str, Any] = {"conversation_id": uuid.uuid4(), "request_id": "r1", "tenant": "t"}

    async def write() -> list[bytes]:
        recorder = Recorder()
        output = Output(recorder, "w", CLEAR)  # type: ignore[arg-type]
        output.start(1, 7, GenerationStarted(**ids, model="m", worker="w", reply_seq=1,
                                             prompt_tokens=3), b"k", 0, None)
        output.delta(1, 7, 0, 'he said "\u2603"\n', (5, 6), 0)
        finished = GenerationFinished(**ids, model="m", reply_seq=1, finish_reason="stop",
                                      text="x", usage=Usage(prompt_tokens=3, completion_tokens=2),
                                      deltas=1, duration_ms=2.0)
        output.end(1, 7, finished, b"k", output.encoded(finished, None))
        failed = GenerationFailed(**ids, code="engine_dead", message="gone")
        output.end(2, 8, failed, b"k", output.encoded(failed, None))
        output.flush(0)
        return recorder.values

    values = asyncio.run(write())
    assert len(values) == 2  # one record per partition
    for value in values:
        validator.validate(json.loads(value))
        CLEAR.decode_live(value)
    bad = json.loads(values[0])
    bad["deltas"][0][1] = -1
    assert not validator.is_valid(bad)
    try:
        CLEAR.decode_live(json.dumps(bad).encode())
    except DecodeError:
        pass
    else:
        raise AssertionError("a negative seq decoded")


def test_asyncapi_document_is_complete_and_its_references_resolve() -> None:
    text = (REPO_ROOT / contract.CONTRACT_DIR / contract.ASYNCAPI_FILE).read_text()
    doc = yaml.safe_load(text)
    assert doc["asyncapi"].startswith("3.")
    addresses = {c["address"] for c in doc["channels"].values()}
    assert {*CONVERSATION_TOPICS, LIVE} <= addresses
    for channel in doc["channels"].values():
        kafka = channel["bindings"]["kafka"]
        assert kafka["partitions"] >= 1 and "retention.ms" in kafka["topicConfiguration"]
    # Every event type is published on some channel, with its payload schema.
    published = {m for c in doc["channels"].values() for m in c["messages"]}
    schema_events = set(json.loads((REPO_ROOT / contract.CONTRACT_DIR /
                                    contract.SCHEMA_FILE).read_text())["discriminator"][
        "mapping"])
    assert schema_events <= published
    for name in schema_events:
        assert doc["components"]["messages"][name]["description"].startswith("Delivery: ")

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [node["$ref"]] if "$ref" in node else [r for v in node.values()
                                                          for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):
        node: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            assert isinstance(node, dict) and part in node, f"unresolved {ref}"
            node = node[part]


def test_every_field_of_every_event_has_a_class() -> None:
    """The contract's classes (schemas.content.FIELD_CLASSES) name each field the code
    has, and no other: a new field is classified before it ships."""
    models = {m.__name__: m for m in (*EVENT_TYPES, SamplingParams)}
    assert set(FIELD_CLASSES) == set(models)
    for name, model in models.items():
        assert set(FIELD_CLASSES[name]) == set(model.model_fields), name
    schema = event_schema()["$defs"]
    for name in models:
        assert all("x-class" in p for p in schema[name]["properties"].values()), name


def test_every_sealed_field_is_in_the_box() -> None:
    """A marker in every field classed sealed is nowhere in the encoded record, and
    comes back when the box opens."""
    marker = "MARKER-7c1e"
    conversation = uuid.uuid4()
    key, _ = sealing.new_data_key(conversation)
    ids: dict[str, Any] = {"conversation_id": conversation, "request_id": "r1", "tenant": "t"}
    events = [
        PromptSubmitted(**ids, model="m", messages=(ChatMessage(role="user", content=marker),),
                        history_len=1, history=(ChatMessage(role="user", content=marker),),
                        history_digest=hashlib.sha256(marker.encode()).hexdigest(),
                        sampling=SamplingParams(stop=(marker,)), memory=True, user=marker,
                        recalled=(Recalled(id="chatcmpl-x", text=marker),)),
        SessionCreated(**ids, title=marker, memory_user=marker),
        GenerationFinished(**ids, model="m", reply_seq=1, finish_reason="stop", text=marker,
                           usage=Usage(prompt_tokens=1, completion_tokens=1), deltas=1,
                           duration_ms=1.0)]
    digest = hashlib.sha256(marker.encode()).hexdigest().encode()
    codec = Codec(sealing.Cipher(_OneKey(key)))
    for event in events:
        raw = codec.encode(event, key)
        assert marker.encode() not in raw and digest not in raw, event.type
        assert codec.decode(raw) == event


class _OneKey:
    def __init__(self, key: sealing.DataKey) -> None:
        self.key = key

    def for_writing(self, conversation_id: uuid.UUID) -> sealing.DataKey | None:
        return None

    def for_reading(self, key_id: str, wait: bool = True,
                    written_at: float | None = None) -> sealing.DataKey | None:
        return self.key if key_id == self.key.key_id else None

    def revoked(self, conversation_id: uuid.UUID) -> bool:
        return False
