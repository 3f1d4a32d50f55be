"""Topic names and their layout. The chat topics are keyed by conversation id and must
have the same partition count, so a conversation lives in the same partition number of
each, and the worker that owns a partition of ``chat.prompts`` owns the same partition
of ``chat.control`` (range assignment).

* ``chat.prompts``: ``PromptSubmitted`` only; its consumer lag is the workers' backlog.
* ``chat.control``: facts about turns and sessions (cancel, a client detached or
  attached, a session created or deleted). A full worker stops fetching prompts but
  never control, so a cancel reaches a turn however busy its worker is.
* ``chat.generations``: each turn's start and end, with its whole text (the durable
  record of what the workers generated; with ``chat.prompts`` and ``chat.control``,
  kept forever by default).
* ``chat.live``: the text of running turns as it comes, many turns to a record
  (``schemas.live``), for clients following a turn, resumes and takeovers; kept for a
  bounded window (7 days by default).
* ``chat.workers``: the workers' heartbeats (compacted; ``pipeline.roster``).
* ``chat.rollouts``: every change of which version serves a model alias, kept forever
  (``schemas.rollout``).
* ``chat.keys``: each conversation's data keys, wrapped by the key-encryption key
  (``pipeline.keystore``), in the partition of its conversation. Compacted: a destroyed
  key's tombstone makes the broker delete its record within ``erasure_window_ms``.
* ``chat.erasures``: the conversations whose keys were destroyed, kept twice the erasure
  window (``pipeline.erasures``): every keyring reads it whole and refuses their keys.
* ``chat.rotations``: where each KEK rotation wrote the keys anew (``pipeline.rotations``).
"""

from __future__ import annotations

from dataclasses import dataclass

PROMPTS = "chat.prompts"
CONTROL = "chat.control"
GENERATIONS = "chat.generations"
# The durable record: every topic a conversation's events live in, in the order readers
# fold them.
CONVERSATION_TOPICS = (PROMPTS, CONTROL, GENERATIONS)
LIVE = "chat.live"
DEADLETTER = "chat.deadletter"
WORKERS = "chat.workers"
# Model aliases and rollouts: which version serves an alias's turns (``schemas.rollout``).
ROLLOUTS = "chat.rollouts"
# The conversations' data keys (``pipeline.keystore``).
KEYS = "chat.keys"
# What the store is projected from: the durable record, and the keys' index (data_keys).
STORE_TOPICS = (*CONVERSATION_TOPICS, KEYS)
# The topics keyed by conversation, which hold it in one partition number of each: one
# partition count for all of them (``pipeline.keystore`` checks it at every start).
PARTITIONED_ALIKE = (*CONVERSATION_TOPICS, LIVE, KEYS)
# The conversations whose data keys were destroyed lately (``pipeline.erasures``).
ERASURES = "chat.erasures"
# KEK rotations: where each wrote the keys anew (``pipeline.rotations``).
ROTATIONS = "chat.rotations"
# The name workers give themselves in dead letters; also the consumer group every worker
# shared before groups were per model (``workers_group``), whose offsets a model's group
# starts from the first time.
WORKERS_GROUP = "workers"


def workers_group(model: str) -> str:
    """The consumer group of the workers serving ``model``. Each model's group reads every
    prompt (all of ``chat.prompts``, in order, so the turn ledger is the same in every
    group) and runs only its model's, so two models are served side by side and a
    conversation keeps its partition, and so its worker and prefix cache, per model."""
    return f"{WORKERS_GROUP}.{model}"


# How far apart the clocks that time the log may be: a prompt's event says its
# gateway's time, a turn's records (chat.live, chat.generations) its worker's, every
# other record the time its broker appended it (``topic_specs``). A reader that finds a
# turn's records by time (a takeover's scan, a stream read from a turn's start) starts
# this long before its prompt's time.
CLOCK_SKEW_MS = 60_000
# Whose clock each record's time is (``message.timestamp.type``). The broker's, where a
# writer's clock is not needed: Kafka 4 refuses a record stamped an hour ahead of the
# broker (message.timestamp.after.max.ms), which aborts the transaction it is in. A
# turn's records keep their worker's, the clock of the turn's own events that readers
# find them by (a stream resumed from a turn's start reads from its start event's time
# less 2 s): stamped by the broker, a worker 2 s ahead would have resumed streams begin
# after their first deltas.
BROKER_TIME = {"message.timestamp.type": "LogAppendTime"}
WRITER_TIME = {"message.timestamp.type": "CreateTime"}
WRITER_TIMED = (GENERATIONS, LIVE)
# Room for a dead letter's headers beyond the record it parks.
DEADLETTER_HEADROOM = 64 * 1024


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]
    replication: int | None = None  # None: the cluster's default.replication.factor


@dataclass(frozen=True)
class TopicPolicy:
    """How the pipeline's topics are created (``PIPELINE_*`` settings, see docs/running.md)."""

    partitions: int = 6
    replication: int | None = None  # None: min(3, brokers)
    min_insync_replicas: int | None = None  # None: 2 with 3 or more replicas, else 1
    retention_ms: int = -1  # the log is the system of record: forever by default
    retention_bytes: int = -1
    deadletter_retention_ms: int = 14 * 24 * 3600 * 1000
    # The live stream: longer than the longest turn and than any resume window.
    live_retention_ms: int = 7 * 24 * 3600 * 1000
    # The largest record a chat topic takes (its max.message.bytes, and every producer's
    # message.max.bytes): a prompt or a reply that would pass it is refused alone.
    max_record_bytes: int = 8 * 2**20
    # How long a destroyed data key's record may stay in chat.keys before the broker's
    # compaction deletes it (max.compaction.lag.ms and segment.ms), and how long its
    # tombstone stays for readers behind (delete.retention.ms).
    erasure_window_ms: int = 24 * 3600 * 1000


def topic_specs(policy: TopicPolicy, brokers: int) -> list[TopicSpec]:
    """The topics the pipeline needs, on a cluster of ``brokers`` nodes. An
    acknowledged record is on ``min.insync.replicas`` brokers (``acks=all``), and only a
    replica that was in sync may become leader, so no acknowledged record is lost to a
    failover."""
    replication = policy.replication or min(3, brokers)
    if replication > brokers:
        raise ValueError(f"replication factor {replication} needs at least that many "
                         f"brokers; the cluster has {brokers}")
    min_isr = policy.min_insync_replicas or (2 if replication >= 3 else 1)
    # Every setting a topic's records depend on is said, even where it is the broker's
    # default: ``pipeline topics`` checks a topic that exists against it.
    base = {"cleanup.policy": "delete", "min.insync.replicas": str(min_isr),
            "unclean.leader.election.enable": "false",
            "max.message.bytes": str(policy.max_record_bytes), **BROKER_TIME}
    log = {**base, "retention.ms": str(policy.retention_ms),
           "retention.bytes": str(policy.retention_bytes)}
    # A dead letter is the record it parks plus headers saying why.
    parked = {**base, "retention.ms": str(policy.deadletter_retention_ms),
              "max.message.bytes": str(policy.max_record_bytes + DEADLETTER_HEADROOM)}
    return [
        TopicSpec(PROMPTS, policy.partitions, log, replication),
        # Stamped by the broker: a client's departure counts from when it is in the log
        # (workers.control), which during an outage is later than it was written.
        TopicSpec(CONTROL, policy.partitions, log, replication),
        TopicSpec(GENERATIONS, policy.partitions, {**log, **WRITER_TIME}, replication),
        TopicSpec(LIVE, policy.partitions, {**base, "retention.ms": str(policy.live_retention_ms),
                                            "retention.bytes": "-1", **WRITER_TIME},
                  replication),
        TopicSpec(DEADLETTER, 1, parked, replication),
        # Heartbeats: only each worker's latest matters, and only for seconds.
        TopicSpec(WORKERS, 1, {**base, "cleanup.policy": "compact,delete",
                               "retention.ms": str(3600 * 1000)}, replication),
        # Routing changes: few, and the audit of which version served when.
        TopicSpec(ROLLOUTS, 1, {**base, "retention.ms": "-1", "retention.bytes": "-1"},
                  replication),
        TopicSpec(KEYS, policy.partitions, {
            **base, "cleanup.policy": "compact", "min.compaction.lag.ms": "0",
            "max.compaction.lag.ms": str(policy.erasure_window_ms),
            "segment.ms": str(policy.erasure_window_ms),
            "delete.retention.ms": str(policy.erasure_window_ms)}, replication),
        # Longer than a destroyed key's record can outlive its tombstone; few records.
        TopicSpec(ERASURES, 1, {**base, "cleanup.policy": "delete",
                                "retention.ms": str(2 * policy.erasure_window_ms),
                                "retention.bytes": "-1"}, replication),
        # A record per KEK rotation, kept while chat.keys is (forever).
        TopicSpec(ROTATIONS, 1, {**base, "cleanup.policy": "compact"}, replication),
    ]
