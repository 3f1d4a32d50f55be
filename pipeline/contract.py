"""The event contract for third-party consumers, generated from the code: a JSON Schema
of every event of the durable record and one of the live stream's records (from the
pydantic models), and an AsyncAPI 3 document of the topics (keys, partitioning,
ordering, headers, retention, and what a reader may see twice).

``pipeline contract`` writes them under ``docs/contract/``; ``pipeline contract --check``
(and the test suite) fails when the files no longer match the code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from pipeline.topics import (
    CONTROL,
    DEADLETTER,
    GENERATIONS,
    LIVE,
    PROMPTS,
    ROLLOUTS,
    TopicPolicy,
    topic_specs,
)
from schemas import EVENT_ADAPTER
from schemas.content import FIELD_CLASSES
from schemas.live import LIVE_ADAPTER
from schemas.rollout import Rollout

CONTRACT_DIR = Path("docs") / "contract"
SCHEMA_FILE = "events.schema.json"
LIVE_SCHEMA_FILE = "live.schema.json"
ASYNCAPI_FILE = "asyncapi.yaml"
_KAFKA = {"bindingVersion": "0.5.0"}

TOPIC_EVENTS = {
    PROMPTS: ["PromptSubmitted"],
    CONTROL: ["GenerationCancelled", "ClientDetached", "ClientAttached", "SessionCreated",
              "SessionDeleted", "MemoryForgotten"],
    GENERATIONS: ["GenerationStarted", "GenerationFinished", "GenerationFailed", "TokenDelta"],
}
TOPIC_ABOUT = {
    PROMPTS: "Turns the gateway accepted (a 2xx answer means the prompt is here): each "
             "turn's new messages, and its session's history by reference to the previous "
             "turn (or inline). The workers' consumer groups read it; what their commits "
             "say waits (offset metadata next=N;waiting=W) is the backlog.",
    CONTROL: "Facts about turns and sessions: cancel, a client detached or attached, a "
             "session created or deleted, a user's memory forgotten. A client's departure "
             "counts from its record's broker time (LogAppendTime).",
    GENERATIONS: "Each turn's start (at its first token) and end, with its whole text, "
                 "usage and timings, or its failure: the durable record of what the workers "
                 "generated, written in Kafka transactions: read with "
                 "isolation.level=read_committed, or you will see aborted attempts. "
                 "TokenDelta events are only in logs written before chat.live existed.",
}
# What a reader may see more than once, and how to drop the copies.
SEEN_TWICE = {
    "PromptSubmitted": "Possibly twice, byte for byte the same record (a gateway's "
                       "producer replaced mid-transaction sends it again): keep the first "
                       "per request_id.",
    "GenerationStarted": "Once per attempt: a turn taken over by another worker has one "
                         "with attempt n > 0. Count a turn's start once per request_id.",
    "TokenDelta": "(Logs from before chat.live.) A (request_id, seq) may appear twice "
                  "when a worker's producer was replaced; an attempt never repeats a seq an "
                  "earlier one wrote. Keep the first per (request_id, seq).",
    "GenerationFinished": "At most one per turn is meant; a replaced producer can repeat "
                          "it. Keep the first per request_id.",
    "GenerationFailed": "As GenerationFinished: keep the first end per request_id.",
}
DEADLETTER_HEADERS = {
    "source.topic": "the topic the record was read from",
    "source.partition": "its partition",
    "source.offset": "its offset",
    "reason": "why it could not be handled (the decoding error)",
    "consumer": "who parked it: worker, projector, gateway, analytics",
}


def _schema(adapter: TypeAdapter[Any], name: str, title: str,
            description: str) -> dict[str, Any]:
    schema = adapter.json_schema(ref_template="#/$defs/{model}")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://chat-pipeline.invalid/contract/{name}.schema.json",
            "title": title, "description": description, **schema}


def live_schema() -> dict[str, Any]:
    return _schema(LIVE_ADAPTER, "live", "Chat pipeline live batch",
                   "Every record value on chat.live: UTF-8 JSON, the entries many "
                   "turns of one partition made in one window (schemas/live.py). "
                   "Readers must ignore fields they do not know.")


def _classified(schema: dict[str, Any]) -> dict[str, Any]:
    """Each event's properties with their class (``x-class``: ``schemas.content``): what
    a field may tell of what a client said, and how the log keeps it."""
    for name, definition in schema.get("$defs", {}).items():
        classes = FIELD_CLASSES.get(name)
        if classes is None:
            continue
        for field, prop in definition.get("properties", {}).items():
            prop["x-class"] = classes[field]
    return schema


def event_schema() -> dict[str, Any]:
    return _classified(_schema(EVENT_ADAPTER, "events", "Chat pipeline event",
                   "Every record value on chat.prompts, chat.control and "
                   "chat.generations: UTF-8 JSON, one event, told apart by "
                   "`type`. Readers must ignore fields they do not know (a newer "
                   "writer may add some; `v` counts each event type's versions). Each "
                   "property's x-class says what it may tell of what a client said: "
                   "sealed (in the record's box, with the conversation's data key), "
                   "digest (a keyed digest), choice (a number, flag or configured name "
                   "the client chose), server (made by the pipeline), legacy (written in "
                   "the clear by code from before the live stream)."))


def asyncapi() -> dict[str, Any]:
    policy = TopicPolicy()
    specs = {s.name: s for s in topic_specs(policy, brokers=3)}
    defs = EVENT_ADAPTER.json_schema(ref_template="#/components/schemas/{model}")["$defs"]
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for topic, events in TOPIC_EVENTS.items():
        spec = specs[topic]
        name = topic.split(".", 1)[1]
        channels[name] = {
            "address": topic,
            "title": topic,
            "description": TOPIC_ABOUT[topic] + " Key: the conversation id; every event "
                           "of a conversation is in the same partition number of each "
                           "chat topic, in the order it happened.",
            "messages": {e: {"$ref": f"#/components/messages/{e}"} for e in events},
            "bindings": {"kafka": {
                "topic": topic, "partitions": spec.partitions, "replicas": spec.replication,
                "topicConfiguration": {
                    "cleanup.policy": ["delete"],
                    "retention.ms": int(spec.config["retention.ms"]),
                    "retention.bytes": int(spec.config["retention.bytes"]),
                }, **_KAFKA}},
        }
        operations[f"read{name.capitalize()}"] = {
            "action": "receive", "channel": {"$ref": f"#/channels/{name}"},
            "summary": f"Read {topic} (in a consumer group of your own).",
            "messages": [{"$ref": f"#/channels/{name}/messages/{e}"} for e in events],
        }
    live = specs[LIVE]
    channels["live"] = {
        "address": LIVE, "title": LIVE,
        "description": "The text of running turns as it comes, for clients following a "
                       "turn, resumes and takeovers: one LiveBatch per partition per "
                       "engine step, many turns to a record, written in the same "
                       "transactions as chat.generations (read_committed). No key: each "
                       "record goes to the partition number its conversations have in the "
                       "other chat topics. An entry names its turn by its reference, the "
                       "offset of the turn's prompt in chat.prompts (GenerationStarted.ref "
                       "gives it too; a start entry gives the request id). Kept for a "
                       "bounded window (PIPELINE_LIVE_RETENTION_MS, 7 days by default): the "
                       "durable record has every turn's whole text forever.",
        "messages": {"LiveBatch": {"$ref": "#/components/messages/LiveBatch"}},
        "bindings": {"kafka": {
            "topic": LIVE, "partitions": live.partitions, "replicas": live.replication,
            "topicConfiguration": {"cleanup.policy": ["delete"],
                                   "retention.ms": int(live.config["retention.ms"]),
                                   "retention.bytes": int(live.config["retention.bytes"])},
            **_KAFKA}},
    }
    operations["readLive"] = {
        "action": "receive", "channel": {"$ref": "#/channels/live"},
        "summary": f"Read {LIVE} (assign the partitions you need).",
        "messages": [{"$ref": "#/channels/live/messages/LiveBatch"}]}
    dead = specs[DEADLETTER]
    channels["deadletter"] = {
        "address": DEADLETTER, "title": DEADLETTER,
        "description": "Records a consumer could not handle, byte for byte as read, "
                       "with where they came from and why in their headers.",
        "messages": {"DeadLetter": {"$ref": "#/components/messages/DeadLetter"}},
        "bindings": {"kafka": {
            "topic": DEADLETTER, "partitions": dead.partitions, "replicas": dead.replication,
            "topicConfiguration": {"cleanup.policy": ["delete"],
                                   "retention.ms": int(dead.config["retention.ms"])},
            **_KAFKA}},
    }
    operations["readDeadletter"] = {
        "action": "receive", "channel": {"$ref": "#/channels/deadletter"},
        "messages": [{"$ref": "#/channels/deadletter/messages/DeadLetter"}]}
    routing = specs[ROLLOUTS]
    channels["rollouts"] = {
        "address": ROLLOUTS, "title": ROLLOUTS,
        "description": "Every change of which version serves a model alias: a rollout "
                       "started, its progress, its promotion or rollback. Key: the alias; "
                       "the latest record per alias is in force. Each turn's own routing "
                       "is in its PromptSubmitted (model, alias, rollout).",
        "messages": {"Rollout": {"$ref": "#/components/messages/Rollout"}},
        "bindings": {"kafka": {
            "topic": ROLLOUTS, "partitions": routing.partitions,
            "replicas": routing.replication,
            "topicConfiguration": {"cleanup.policy": ["delete"],
                                   "retention.ms": int(routing.config["retention.ms"])},
            **_KAFKA}},
    }
    operations["readRollouts"] = {
        "action": "receive", "channel": {"$ref": "#/channels/rollouts"},
        "messages": [{"$ref": "#/channels/rollouts/messages/Rollout"}]}
    rollout_schema = Rollout.model_json_schema(ref_template="#/components/schemas/{model}")
    live_batch = LIVE_ADAPTER.json_schema(ref_template="#/components/schemas/{model}")
    defs = {**defs, **rollout_schema.pop("$defs", {}), "Rollout": rollout_schema,
            **live_batch.pop("$defs", {}), "LiveBatch": live_batch}
    messages: dict[str, Any] = {}
    for events in TOPIC_EVENTS.values():
        for e in events:
            messages[e] = {
                "name": e, "title": e, "contentType": "application/json",
                "summary": (defs[e].get("description") or e).split("\n")[0],
                "description": "Delivery: " + SEEN_TWICE.get(
                    e, "Possibly twice (a producer's retry): facts, safe to apply again."),
                "payload": {"$ref": f"#/components/schemas/{e}"},
                "bindings": {"kafka": {
                    "key": {"type": "string", "format": "uuid",
                            "description": "conversation_id, UTF-8"}, **_KAFKA}},
            }
    messages["LiveBatch"] = {
        "name": "LiveBatch", "title": "LiveBatch", "contentType": "application/json",
        "summary": "What the running turns of one partition produced in one window.",
        "description": "Delivery: a replaced producer can repeat a record; keep the first "
                       "delta per (turn, seq), the first start per (turn, attempt), the "
                       "first end per turn. An attempt never repeats a seq an earlier one "
                       "wrote.",
        "payload": {"$ref": "#/components/schemas/LiveBatch"},
        "bindings": {"kafka": {"key": {"type": "null"}, **_KAFKA}},
    }
    messages["DeadLetter"] = {
        "name": "DeadLetter", "title": "DeadLetter",
        "summary": "A record parked by a consumer: the original key and value.",
        "headers": {"type": "object", "properties": {
            k: {"type": "string", "description": v} for k, v in DEADLETTER_HEADERS.items()}},
        "payload": {"description": "The original value's bytes (not necessarily JSON)."},
    }
    messages["Rollout"] = {
        "name": "Rollout", "title": "Rollout", "contentType": "application/json",
        "summary": "Which version serves a model alias, and any rollout under way.",
        "payload": {"$ref": "#/components/schemas/Rollout"},
        "bindings": {"kafka": {"key": {"type": "string", "description": "the alias, UTF-8"},
                               **_KAFKA}},
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Chat pipeline event log",
            "version": "1.0.0",
            "description": (
                "The log is the system of record: every fact about a conversation is an "
                "event on these topics. Keys are conversation ids (UTF-8 UUID text), "
                "partitioned with Kafka's default murmur2 partitioner, so one "
                "conversation's events are in one partition of each topic, in order; "
                "there is no order across conversations or topics. Read "
                "`read_committed`. Values are JSON (components/schemas; the JSON "
                "Schemas are events.schema.json and live.schema.json beside this file). "
                "Two retention classes: the durable record (chat.prompts, chat.control, "
                "chat.generations) is kept forever by default (retention -1; "
                "PIPELINE_RETENTION_MS changes it); the live stream (chat.live) for 7 days "
                "(PIPELINE_LIVE_RETENTION_MS); dead letters 14 days. A record's Kafka "
                "timestamp is its writer's clock on chat.live and chat.generations "
                "(CreateTime, the worker's, as its events' occurred_at) and its broker's "
                "elsewhere (LogAppendTime, since 2026-12-02). Every reader must "
                "tolerate the copies each message's description names: de-duplicate by "
                "request_id, and deltas by (turn, seq)."),
        },
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:9092", "protocol": "kafka",
                              "description": "`pipeline infra up`"}},
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": defs},
    }


def render() -> dict[str, str]:
    """Each file's text, as it must be checked in."""
    return {
        SCHEMA_FILE: json.dumps(event_schema(), indent=2, ensure_ascii=False) + "\n",
        LIVE_SCHEMA_FILE: json.dumps(live_schema(), indent=2, ensure_ascii=False) + "\n",
        ASYNCAPI_FILE: "# Generated by `pipeline contract` from pipeline/contract.py: do not "
                       "edit.\n" + yaml.safe_dump(asyncapi(), sort_keys=False,
                                                 allow_unicode=True, width=88),
    }


def stale(root: Path) -> list[str]:
    """The contract files under ``root`` that differ from the code (or are missing)."""
    return [name for name, text in render().items()
            if not (root / CONTRACT_DIR / name).is_file()
            or (root / CONTRACT_DIR / name).read_text() != text]


def write(root: Path) -> list[Path]:
    out = root / CONTRACT_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render().items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths
