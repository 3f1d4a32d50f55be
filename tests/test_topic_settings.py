"""Topics that exist with settings that lose records (made by hand, by a broker that makes
the topics a client names, by an earlier version): every process refuses to start on
them, in one line that says what to do, ``pipeline topics`` shows each setting that
differs from the pipeline's, and ``--fix`` sets them, but never makes a topic keep less.
On a broker of its own: the topics are made wrong on purpose."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    KafkaException,
    Message,
    Producer,
)
from confluent_kafka.admin import AdminClient

from pipeline.kafka import ensure_topics, set_topic_configs, topic_configs
from pipeline.kafka.clock import BrokerClock
from pipeline.kafka.plain import PlainWriter
from pipeline.keylimits import KeyringError
from pipeline.keystore import open_keyring
from pipeline.roster import Roster
from pipeline.settings import CommonSettings
from pipeline.topicconfig import hazards
from pipeline.topics import (
    CONTROL,
    ERASURES,
    GENERATIONS,
    KEYS,
    LIVE,
    PROMPTS,
    WORKERS,
    WRITER_TIMED,
    TopicPolicy,
    TopicSpec,
    topic_specs,
)
from tests.conftest import PARTITIONS, Stack, own_broker

pytestmark = pytest.mark.integration

WEEK_MS = 7 * 24 * 3600 * 1000
HOUR_MS = 3600 * 1000
# What a broker's defaults and an operator's hand would have given them.
WRONG = {
    KEYS: {"cleanup.policy": "delete", "retention.ms": str(WEEK_MS)},
    PROMPTS: {"cleanup.policy": "compact"},
    ERASURES: {"retention.ms": str(HOUR_MS)},
    GENERATIONS: {"retention.ms": str(WEEK_MS)},  # refused unless the processes are told
    CONTROL: {"message.timestamp.type": "CreateTime"},
    # Keeps more than the pipeline's 7 days; its records timed by the broker, not by the
    # worker whose events readers find them by.
    LIVE: {"retention.ms": "-1", "message.timestamp.type": "LogAppendTime"},
}


def made_wrong(spec: TopicSpec) -> TopicSpec:
    wrong = WRONG.get(spec.name, {})
    config = {k: v for k, v in spec.config.items()
              if k not in wrong and not (spec.name == KEYS and "compaction" in k)}
    return TopicSpec(spec.name, spec.partitions, {**config, **wrong}, spec.replication)


@pytest.fixture(scope="module")
def cluster(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # A broker that makes the topics clients name, and drops a group's offsets 7 days
    # after its last member left, as Kafka's defaults are.
    specs = [made_wrong(s) for s in topic_specs(TopicPolicy(PARTITIONS), 1)]
    with own_broker(tmp_path_factory, "settings", specs,
                    **{"auto.create.topics.enable": "true",
                       "offsets.retention.minutes": str(7 * 24 * 60)}) as bootstrap:
        yield Stack(bootstrap, stack.database_url, stack.logs)


def pipeline(cluster: Stack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True,
                          text=True, timeout=120, env=cluster.env(**env))


def test_settings_that_lose_records_refuse_every_start_and_are_fixed(
        cluster: Stack, caplog: pytest.LogCaptureFixture) -> None:
    common = CommonSettings(kafka_bootstrap=cluster.bootstrap)
    with pytest.raises(KeyringError) as refused:
        open_keyring(common, "settings-test")
    said = str(refused.value)
    for topic, setting in ((KEYS, "cleanup.policy"), (PROMPTS, "cleanup.policy"),
                           (ERASURES, "retention.ms"), (GENERATIONS, "retention.ms")):
        assert f"{topic} has {setting}=" in said, said
    assert "pipeline topics --fix" in said
    # A durable record kept a week is the operator's to choose, told to every process.
    as_made = topic_configs(cluster.bootstrap, [GENERATIONS])
    assert hazards(as_made, common.topic_policy()) != []
    assert hazards(as_made, TopicPolicy(retention_ms=WEEK_MS)) == []

    # An audit or a replay only reads: a cluster losing records needs it most. Said.
    with caplog.at_level(logging.WARNING, "pipeline.topicconfig"), \
            open_keyring(common, "settings-audit", reading=True):
        pass
    assert any(f"{KEYS} has cleanup.policy=delete" in r.message for r in caplog.records)
    said = [r.message for r in caplog.records]
    assert any(m.startswith(f"{CONTROL} take each record's time from its writer's clock")
               for m in said), said
    assert any(m.startswith(f"{LIVE} take each record's time from the broker")
               for m in said), said
    caplog.clear()

    # A service says so in one line and stops: it does not retry what will not change.
    projector = pipeline(cluster, "projector")
    assert projector.returncode == 2, projector.stderr[-2000:]
    assert projector.stderr.startswith("pipeline projector: ")
    assert f"{KEYS} has cleanup.policy=delete" in projector.stderr
    assert len(projector.stderr.splitlines()) == 1, projector.stderr

    shown = pipeline(cluster, "topics")
    assert shown.returncode == 1, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert f"  retention.ms={WEEK_MS} (the pipeline's: -1); --fix sets it" in lines
    assert "  message.timestamp.type=CreateTime (the pipeline's: LogAppendTime); --fix sets " \
           "it" in lines
    assert any(line.startswith("  retention.ms=-1 (the pipeline's: 604800000); left as it is")
               for line in lines), shown.stdout
    assert "services refuse to start" in shown.stderr
    assert "warning: the brokers keep a consumer group's offsets 7 days" in shown.stderr

    fixed = pipeline(cluster, "topics", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    configs = topic_configs(cluster.bootstrap, [KEYS, PROMPTS, ERASURES, GENERATIONS, CONTROL,
                                                LIVE])
    assert configs[KEYS]["cleanup.policy"] == "compact"
    assert configs[KEYS]["max.compaction.lag.ms"] == str(common.erasure_window_ms)
    assert configs[PROMPTS]["cleanup.policy"] == "delete"
    assert configs[ERASURES]["retention.ms"] == str(2 * common.erasure_window_ms)
    assert configs[GENERATIONS]["retention.ms"] == "-1"
    assert {t: configs[t]["message.timestamp.type"] for t in configs} == {
        t: "CreateTime" if t in WRITER_TIMED else "LogAppendTime" for t in configs}
    assert configs[LIVE]["retention.ms"] == "-1"  # never lowered: that deletes records
    assert hazards(configs, common.topic_policy()) == []
    with caplog.at_level(logging.WARNING, "pipeline.topicconfig"), \
            open_keyring(common, "settings-test"):
        pass
    assert [r.message for r in caplog.records
            if "offsets.retention.minutes" in r.message], caplog.text

    # Erasures kept forever lose nothing, but every start reads them all: said, not fixed
    # (lowering it deletes records).
    set_topic_configs(cluster.bootstrap, {ERASURES: {"retention.ms": "-1"}})
    shown = pipeline(cluster, "topics", "--fix")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"warning: {ERASURES} keeps erasures forever" in shown.stderr
    set_topic_configs(cluster.bootstrap, {ERASURES: {"retention.ms": str(
        2 * common.erasure_window_ms)}})

    # A process whose erasure window is shorter than the one the topics keep would forget
    # an erasure while the erased keys' records may still be there.
    short = CommonSettings(kafka_bootstrap=cluster.bootstrap, erasure_window_ms=HOUR_MS)
    with pytest.raises(KeyringError, match=f"{KEYS} has max.compaction.lag.ms="):
        open_keyring(short, "settings-test")


def test_a_topic_stamped_by_its_broker_takes_a_record_whatever_its_writers_clock(
        cluster: Stack) -> None:
    """A host whose clock is an hour ahead (its time service lost) or a year behind: each
    topic the pipeline has its brokers stamp takes its records in a transaction, stamped
    with the broker's time, where one stamped by its writers (Kafka 4 refuses records an
    hour ahead) aborts the whole transaction. A turn's records keep their worker's time,
    the clock of the events readers find them by."""
    specs = [TopicSpec(f"skew.{s.name}", 1, s.config)
             for s in topic_specs(TopicPolicy(PARTITIONS), 1)]
    ensure_topics(cluster.bootstrap, specs)
    by_broker = [s.name for s in specs if s.name.removeprefix("skew.") not in WRITER_TIMED]
    by_writer = [s.name for s in specs if s.name.removeprefix("skew.") in WRITER_TIMED]
    assert len(by_writer) == len(WRITER_TIMED) and by_broker
    now_ms = int(time.time() * 1000)

    def stamps(topics: list[str], skew_ms: int) -> list[int]:
        producer = Producer({"bootstrap.servers": cluster.bootstrap,
                             "transactional.id": f"skew-{uuid.uuid4()}"})
        producer.init_transactions(30)
        producer.begin_transaction()
        times: list[int] = []
        for topic in topics:
            producer.produce(topic, b"v", b"k", timestamp=now_ms + skew_ms,  # compacted: keyed
                             on_delivery=lambda e, m: e or times.append(m.timestamp()[1]))
        producer.flush(30)
        producer.commit_transaction(30)
        return times

    for skew_ms in (HOUR_MS + 60_000, -365 * 24 * HOUR_MS):
        times = stamps(by_broker, skew_ms)
        assert len(times) == len(by_broker)
        assert all(abs(t - now_ms) < 60_000 for t in times), (skew_ms, times)
    assert stamps(by_writer, 10_000) == [now_ms + 10_000] * len(by_writer)
    with pytest.raises(KafkaException, match="Invalid timestamp"):
        stamps([by_writer[0], by_broker[0]], HOUR_MS + 60_000)


def test_a_writer_says_when_its_clock_is_off_the_brokers(
        caplog: pytest.LogCaptureFixture) -> None:
    """A prompt still says its gateway's time, which a resumed stream looks a minute
    before: a writer reads the brokers' clock off its deliveries, and says past 30 s."""
    clock = BrokerClock()
    now_ms = int(time.time() * 1000)
    clock.observe(Message(topic=PROMPTS, timestamp=(TIMESTAMP_CREATE_TIME, now_ms + 90_000)))
    assert clock.ahead_s == 0.0  # its own clock's time: it says nothing of the broker's
    with caplog.at_level(logging.WARNING, "pipeline.kafka.clock"):
        clock.observe(Message(topic=PROMPTS,
                              timestamp=(TIMESTAMP_LOG_APPEND_TIME, now_ms + 90_000)))
    assert 89 < clock.ahead_s < 91
    assert [r.message for r in caplog.records] == [
        "this host's clock is 90 s behind the Kafka brokers': keep it within 60 s (NTP), "
        "or streams resumed from a turn's start may miss its first tokens"]


def test_a_worker_whose_clock_is_behind_is_heard_alive(cluster: Stack) -> None:
    """A gateway counts a worker alive for 10 s from its heartbeat: from when the log had
    it, not from when a worker's clock 30 s behind says it sent it. The heartbeat's
    writer reads the brokers' clock off its delivery, as a worker does."""
    clock = BrokerClock()
    writer = PlainWriter(cluster.bootstrap, "settings-test", durable=False, clock=clock)
    writer.send(WORKERS, b"worker-behind", json.dumps(
        {"model": "model-behind", "at": time.time() - 30}).encode())
    assert writer.flush(10) == []
    assert 0 < abs(clock.ahead_s) < 5, clock.ahead_s
    roster, deadline = Roster(cluster.bootstrap), time.monotonic() + 30
    while "model-behind" not in (alive := roster.refresh()):
        assert time.monotonic() < deadline, alive
        time.sleep(0.2)


def test_a_gateway_whose_clock_is_ahead_hears_workers_alive(
        cluster: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat read as it comes is heard when read, whatever the gateway's clock
    says: one 30 s ahead of the brokers took every heartbeat for 30 s old, so gone."""
    roster = Roster(cluster.bootstrap)
    roster.refresh()  # assigned, and read to the end
    monkeypatch.setattr("pipeline.roster.time", types.SimpleNamespace(
        time=lambda: time.time() + 30, monotonic=time.monotonic))
    writer = PlainWriter(cluster.bootstrap, "settings-test", durable=False)
    writer.send(WORKERS, b"worker-ahead", json.dumps(
        {"model": "model-ahead", "at": time.time() + 30}).encode())
    assert writer.flush(10) == []
    deadline = time.monotonic() + 30
    while "model-ahead" not in (alive := roster.refresh()):
        assert time.monotonic() < deadline, alive
        time.sleep(0.2)


def test_no_client_of_the_pipeline_makes_a_topic_by_naming_it(cluster: Stack) -> None:
    """On a broker that makes topics clients name, a write to a topic that does not exist
    fails, and makes none: a topic made so would have the broker's settings."""
    missing = f"chat.missing-{uuid.uuid4().hex[:8]}"
    writer = PlainWriter(cluster.bootstrap, "settings-test", timeout_s=5)
    writer.send(missing, b"k", b"v")
    assert writer.flush(10), "a write to a missing topic was acknowledged"
    listed = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(timeout=10)
    assert PROMPTS in listed.topics and missing not in listed.topics


def test_analytics_refuses_topics_it_reads_that_do_not_exist(cluster: Stack) -> None:
    """Its consumer (aiokafka's) would have the broker make them, with the broker's
    settings: it made both here, before this check."""
    missing = [f"chat.missing-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    env = {"ANALYTICS_TOPICS": ",".join(missing), "ANALYTICS_SCHEMA_NAME": "settings_test"}
    done = pipeline(cluster, "analytics", **env)
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stderr.splitlines()[-1]
    assert said.startswith("pipeline analytics: the topics chat.missing-"), said
    assert said.endswith("`pipeline topics` makes the pipeline's"), said
    listed = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(timeout=10)
    assert not set(missing) & set(listed.topics)
