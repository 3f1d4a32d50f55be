"""The published event contract (docs/contract/) matches the code, is self-consistent,
and real events validate against it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import jsonschema
import yaml

from pipeline import contract
from pipeline.codec import encode
from pipeline.settings import REPO_ROOT
from pipeline.topics import CONVERSATION_TOPICS, LIVE
from schemas import (
    ChatMessage,
    ClientDetached,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
    TurnRef,
    Usage,
)


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
        validator.validate(json.loads(encode(event)))
    # And it refuses what the code refuses.
    bad = json.loads(encode(events[4]))
    bad["seq"] = -1
    assert not validator.is_valid(bad)
    assert not validator.is_valid({**json.loads(encode(events[0])), "type": "Nope"})


def test_live_records_the_worker_writes_validate_against_the_live_schema() -> None:
    """What ``workers.output`` writes (its own encoder, not pydantic's) is what the
    published schema describes, and what the schema refuses the code refuses too."""
    import asyncio

    from pipeline.codec import DecodeError, decode_live
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
        output = Output(recorder, "w")  # type: ignore[arg-type]
        output.start(1, 7, GenerationStarted(**ids, model="m", worker="w", reply_seq=1,
                                             prompt_tokens=3), b"k", 0, None)
        output.delta(1, 7, 0, 'he said "\u2603"\n', (5, 6), 0)
        output.end(1, 7, GenerationFinished(**ids, model="m", reply_seq=1, finish_reason="stop",
                                            text="x", usage=Usage(prompt_tokens=3,
                                                                  completion_tokens=2),
                                            deltas=1, duration_ms=2.0), b"k", None)
        output.end(2, 8, GenerationFailed(**ids, code="engine_dead", message="gone"), b"k",
                   None)
        output.flush(0)
        return recorder.values

    values = asyncio.run(write())
    assert len(values) == 2  # one record per partition
    for value in values:
        validator.validate(json.loads(value))
        decode_live(value)
    bad = json.loads(values[0])
    bad["deltas"][0][1] = -1
    assert not validator.is_valid(bad)
    try:
        decode_live(json.dumps(bad).encode())
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
