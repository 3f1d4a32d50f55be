"""Topic names and their layout. Both chat topics are keyed by conversation id and
must have the same partition count, so a conversation lives in the same partition
number of each."""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = "chat.prompts"
GENERATIONS = "chat.generations"
DEADLETTER = "chat.deadletter"
# The workers' consumer group. Each worker's client id names the model it serves, so
# anyone can tell from the group's live members which models are served.
WORKERS_GROUP = "workers"
_WORKER_CLIENT = "chat-worker/"


def worker_client_id(model: str) -> str:
    return _WORKER_CLIENT + model


def served_model(client_id: str) -> str | None:
    return client_id[len(_WORKER_CLIENT):] if client_id.startswith(_WORKER_CLIENT) else None


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


def topic_specs(partitions: int) -> list[TopicSpec]:
    """The topics the pipeline needs. The log is the system of record: keep it forever."""
    forever = {"retention.ms": "-1", "min.insync.replicas": "1"}
    return [
        TopicSpec(PROMPTS, partitions, forever),
        TopicSpec(GENERATIONS, partitions, forever),
        TopicSpec(DEADLETTER, 1, forever),
    ]
