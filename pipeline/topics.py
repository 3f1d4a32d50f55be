"""Topic names and their layout. Both chat topics are keyed by conversation id and
must have the same partition count, so a conversation lives in the same partition
number of each."""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = "chat.prompts"
GENERATIONS = "chat.generations"
DEADLETTER = "chat.deadletter"


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
