"""The Kafka adapter: the only package that imports confluent_kafka (``tests/test_layout.py``
holds every other module to that). One concept per module:

* ``client``: what every client shares: ``Record``, ``client_config`` (the operator's
  properties), logging, the poll that turns messages into records.
* ``producer``: ``EventProducer``, idempotent and ``acks=all``; ``send`` returns an
  asyncio future that resolves once Kafka acknowledged the record.
* ``transactions``: ``TransactionalProducer``, records and the reading group's offsets in
  one Kafka transaction, fenced by the transactional id's epoch; its parts are
  ``outbox`` (the queue, its epochs and backpressure), ``transaction_loop`` (the thread
  that commits) and ``watchdog`` (deadlines, stuck transactions).
* ``consumer``: ``AsyncConsumer``, a consumer whose blocking calls run one at a time on a
  thread of its own (its coroutines are what asyncio services await), and
  ``GroupConsumer``, a member of a consumer group (subscribe, commit, pause, rejoin).
* ``reader``: ``LogReader``, which reads the log where it is told (from a partition's
  start or end, exact positions, ranges, offsets by time), outside any assignment.
* ``scans``: reading outside any group: committed offsets, watermarks, ranges.
* ``admin``: reaching the cluster, topics and their limits, SCRAM users.
* ``config``: the operator's client properties file (``PIPELINE_KAFKA_CONFIG``).
* ``raw``: plain clients for the few callers that keep their own records (the roster,
  the rollout's compacted topic, key events), still configured here.

Callers import from ``pipeline.kafka``; the names below are the adapter's surface.
"""

from confluent_kafka import KafkaException

from pipeline.kafka.admin import (
    broker_count,
    broker_setting,
    check_access,
    delete_topics,
    ensure_topics,
    set_scram_password,
    set_topic_configs,
    topic_configs,
    topic_limits,
    topic_names,
    wait_for_broker,
)
from pipeline.kafka.client import (
    BEGINNING,
    LATEST,
    NO_NAGLE,
    RECORD_OVERHEAD,
    Fenced,
    Outgoing,
    ProduceError,
    Record,
    RecordTooLarge,
    client_config,
    client_id,
    client_logging,
    stale_leader,
    unreachable,
)
from pipeline.kafka.config import AccessRefused, ClientConfigError
from pipeline.kafka.consumer import QUICK_ASSIGN, AsyncConsumer, GroupConsumer, StallWatch
from pipeline.kafka.outbox import NotAccepted
from pipeline.kafka.producer import EventProducer
from pipeline.kafka.reader import LogReader
from pipeline.kafka.scans import (
    GroupStatus,
    first_records,
    group_committed,
    high_watermarks,
    iter_spans,
    read_spans,
    scan_partitions,
)
from pipeline.kafka.transactions import TransactionalProducer, TransactionSettings

__all__ = [
    "BEGINNING",
    "LATEST",
    "NO_NAGLE",
    "QUICK_ASSIGN",
    "RECORD_OVERHEAD",
    "AccessRefused",
    "AsyncConsumer",
    "ClientConfigError",
    "EventProducer",
    "Fenced",
    "GroupConsumer",
    "GroupStatus",
    "KafkaException",
    "LogReader",
    "NotAccepted",
    "Outgoing",
    "ProduceError",
    "Record",
    "RecordTooLarge",
    "StallWatch",
    "TransactionSettings",
    "TransactionalProducer",
    "broker_count",
    "broker_setting",
    "check_access",
    "client_config",
    "client_id",
    "client_logging",
    "delete_topics",
    "ensure_topics",
    "first_records",
    "group_committed",
    "high_watermarks",
    "iter_spans",
    "read_spans",
    "scan_partitions",
    "set_scram_password",
    "set_topic_configs",
    "stale_leader",
    "topic_configs",
    "topic_limits",
    "topic_names",
    "unreachable",
    "wait_for_broker",
]
