"""Topic names and their layout. The chat topics are keyed by conversation id and must
have the same partition count, so a conversation lives in the same partition number of
each, and the worker that owns a partition of ``chat.prompts`` owns the same partition
of ``chat.control`` (range assignment).

* ``chat.prompts``: ``PromptSubmitted`` only; its consumer lag is the workers' backlog.
* ``chat.control``: facts about turns and sessions (cancel, a client detached or
  attached, a session created or deleted). A full worker stops fetching prompts but
  never control, so a cancel reaches a turn however busy its worker is.
* ``chat.generations``: what the workers generate.
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = "chat.prompts"
CONTROL = "chat.control"
GENERATIONS = "chat.generations"
# Every topic a conversation's events live in, in the order readers fold them.
CONVERSATION_TOPICS = (PROMPTS, CONTROL, GENERATIONS)
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
        TopicSpec(CONTROL, partitions, forever),
        TopicSpec(GENERATIONS, partitions, forever),
        TopicSpec(DEADLETTER, 1, forever),
    ]
