"""Our murmur2 partitioner agrees with librdkafka's (and so Java's) on a real broker."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Producer

from pipeline.kafka import ensure_topics
from pipeline.partitioning import murmur2, partition_for
from pipeline.topics import TopicSpec
from tests.conftest import PARTITIONS, Stack

pytestmark = pytest.mark.integration


def test_murmur2_matches_kafkas_reference_values() -> None:
    # Values from Kafka's own UtilsTest (org.apache.kafka.common.utils).
    assert murmur2(b"21") == (-973932308) & 0xFFFFFFFF
    assert murmur2(b"foobar") == (-790332482) & 0xFFFFFFFF
    assert murmur2(b"a-little-bit-long-string") == (-985981536) & 0xFFFFFFFF


def test_gateway_and_producer_agree_where_a_conversation_lives(stack: Stack) -> None:
    topic = "test.partitioning"
    ensure_topics(stack.bootstrap, [TopicSpec(topic, PARTITIONS, {})])
    producer = Producer({"bootstrap.servers": stack.bootstrap, "partitioner": "murmur2_random"})
    keys = [str(uuid.uuid4()).encode() for _ in range(30)]
    landed: dict[bytes, int] = {}
    for key in keys:
        producer.produce(topic, key=key, value=b"x",
                         on_delivery=lambda err, msg, k=key: landed.__setitem__(k, msg.partition()))
    assert producer.flush(10) == 0
    assert landed == {k: partition_for(k, PARTITIONS) for k in keys}
    assert len(set(landed.values())) > 1
