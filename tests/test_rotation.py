"""Rotating the key-encryption key while the service runs (``pipeline kek rotate``), on a
broker and a database of its own (a rotation rewrites every key of its cluster) with the
SIMULATED engine: turns go on through it and none is lost, and afterwards a process that
has only the new KEK opens every box the log holds, the ones sealed before included."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from infra.process import free_port
from pipeline.keystore import Keyring
from pipeline.topics import CONTROL, GENERATIONS, LIVE, PROMPTS
from projections.migrate import migrate
from tests.conftest import (
    PARTITIONS,
    Service,
    Stack,
    new_database,
    own_broker,
    start_service,
    wait_healthy,
)
from tests.logread import read_records

pytestmark = pytest.mark.integration


@dataclass
class Cluster:
    stack: Stack
    old: str  # base64 of each KEK
    new: str
    services: dict[str, Service]
    url: str = ""

    def start(self, **kek: str) -> None:
        """Projector, SIMULATED worker and gateway, with these KEK settings."""
        self.stop()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.services = {
            "projector": start_service(self.stack, "rot-projector", "projector", **kek),
            "worker": start_service(self.stack, "rot-worker", "worker", "--engine", "sim",
                                    WORKER_SIM_TOKENS_PER_S="200", **kek),
            "gateway": start_service(self.stack, "rot-gateway", "gateway", "--port",
                                     str(port), GATEWAY_MODELS="sim", **kek),
        }
        wait_healthy(self.url, list(self.services.values()), timeout=90)

    def stop(self) -> None:
        for service in self.services.values():
            service.stop()
        self.services = {}


@pytest.fixture(scope="module")
def cluster(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with own_broker(tmp_path_factory, "rotation") as bootstrap:
        c = Cluster(Stack(bootstrap, new_database(stack.database_url, "rotation"),
                          stack.logs), *(base64.b64encode(os.urandom(32)).decode()
                                         for _ in range(2)), {})
        try:
            migrate(c.stack.database_url)
            yield c
        finally:
            c.stop()


def turn(url: str, text: str, session: str | None = None, stream: bool = False
         ) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      headers={"X-Session-Id": session} if session else {},
                      json={"model": "sim", "max_tokens": 4, "stream": stream,
                            "messages": [{"role": "user", "content": text}]})


def boxes(bootstrap: str) -> list[str]:
    """The key reference of every box the log holds: events' and live batches'."""
    refs = []
    for topic in (PROMPTS, CONTROL, GENERATIONS, LIVE):
        for _, value, _ in read_records(bootstrap, topic):
            data = json.loads(value or b"{}")
            if data.get("sealed") and topic != LIVE:
                refs.append(data["sealed"]["key"])
            elif topic == LIVE:
                refs += [key for _, key, _ in data.get("sealed", ())]
    return refs


def test_a_kek_rotation_under_load_loses_no_turn_and_leaves_every_box_open(
        cluster: Cluster) -> None:
    old_only = {"PIPELINE_KEK": cluster.old}
    both = {"PIPELINE_KEK": cluster.new, "PIPELINE_KEK_PREVIOUS": cluster.old}
    cluster.start(**old_only)
    sessions, streamed = [], []
    for n in range(12):
        r = turn(cluster.url, f"before the rotation {n}", stream=n % 3 == 0)
        assert r.status_code == 200, r.text
        sessions.append(r.headers["x-session-id"])
        if n % 3 == 0:
            streamed.append((r.headers["x-request-id"], r.text))
    # A rolling restart onto the new KEK (the old one still read), then load through the
    # rotation: new sessions and the old ones' next turns.
    cluster.start(**both)
    answers: list[int] = []
    stop = threading.Event()

    def load() -> None:
        n = 0
        while not stop.is_set():
            session = sessions[n % len(sessions)] if n % 2 else None
            answers.append(turn(cluster.url, f"during {n}", session).status_code)
            n += 1

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(1)
        rotated = subprocess_cli(cluster.stack, "kek", "rotate", **both)
        time.sleep(1)
    finally:
        stop.set()
        loader.join(60)
    assert rotated.returncode == 0, rotated.stderr
    assert "wrapped 12 data key(s) anew" in rotated.stdout, rotated.stdout
    assert answers and set(answers) == {200}, answers
    # Run again (by mistake, or to finish a run cut short): nothing is left to write
    # anew, and its record keeps the first run's, whose windows hold the moved keys (it
    # replaced it, and every key of before the rotation was lost to compaction).
    again = subprocess_cli(cluster.stack, "kek", "rotate", **both)
    assert again.returncode == 0, again.stderr
    assert "wrapped 0 data key(s) anew" in again.stdout, again.stdout
    # The old KEK retired: every box of the log opens with the new one alone, those
    # sealed before the rotation through its windows.
    only_new = Keyring(cluster.stack.bootstrap, base64.b64decode(cluster.new), "only-new")
    with only_new:
        refs = sorted(set(boxes(cluster.stack.bootstrap)))
        unopened = [ref for ref in refs if only_new.for_reading(ref) is None]
    assert refs and unopened == [], unopened
    cluster.start(PIPELINE_KEK=cluster.new)
    for session in (sessions[0], sessions[-1]):
        r = httpx.get(f"{cluster.url}/v1/sessions/{session}/messages", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["content"].startswith("before the rotation"), r.json()
    # A stream of before, resumed: its live text opens through the gateway's keyring.
    completion, first = streamed[0]
    again = httpx.get(f"{cluster.url}/v1/chat/completions/{completion}/stream", timeout=30)
    assert again.status_code == 200 and text_of(again.text) == text_of(first), again.text
    after = turn(cluster.url, "after", sessions[1])
    assert after.status_code == 200, after.text


def test_a_rotation_not_finished_keeps_its_old_kek_in_use(cluster: Cluster) -> None:
    """A rotation cut short (Ctrl-C, a crash) left keys the old KEK alone opens: a
    process without that KEK refuses to start, naming the rotation, until a run to the
    same KEK finishes it. Its records are written here as a run writes them."""
    from dataclasses import replace

    from pipeline.kafka.plain import PlainWriter
    from pipeline.kek import fingerprint
    from pipeline.keylimits import KeyringError
    from pipeline.rotations import started
    from pipeline.topics import ROTATIONS

    newest = os.urandom(32)
    new = base64.b64decode(cluster.new)
    cut_short = started(fingerprint(newest), [fingerprint(new)], {0: 0})
    writer = PlainWriter(cluster.stack.bootstrap, "test-rotation")
    writer.send(ROTATIONS, *cut_short.record())
    assert writer.flush(30) == []
    with pytest.raises(KeyringError, match=f"rotation to {fingerprint(newest)} begun "
                                               r"at .* has not finished"):
        Keyring(cluster.stack.bootstrap, newest, "newest-only").start()
    with Keyring(cluster.stack.bootstrap, newest, "both", previous=[new]):
        pass  # the old KEK at hand: it starts, and may finish the rotation
    finished = replace(cut_short, at_ms=cut_short.at_ms + 1, windows={0: (0, 0)}, done=True)
    writer.send(ROTATIONS, *finished.record())
    assert writer.flush(30) == []
    with Keyring(cluster.stack.bootstrap, newest, "newest-only"):
        pass  # a later run to the same KEK finished it


def test_a_key_a_run_cut_short_wrote_after_its_erasure_is_destroyed_by_the_next(
        cluster: Cluster) -> None:
    """A run writes each key anew from what it read: a conversation erased in between
    has its key's tombstone undone by that write, which the run destroys again once it
    has read the erasures. Cut short before that, it left the key live, and its content
    readable once the erasure's record expires: the next run destroys every live key of
    an erased conversation, not only those it wrote. The records are written here as
    that run left them."""
    import uuid

    from pipeline.codec import conversation_key
    from pipeline.erasures import erasure_record
    from pipeline.kafka import iter_spans
    from pipeline.kafka.plain import PlainReader, PlainWriter
    from pipeline.kek import Kek, record_key
    from pipeline.partitioning import partition_for
    from pipeline.topics import ERASURES, KEYS

    conversation = uuid.uuid4()
    key = record_key(conversation, "k1")
    partition = partition_for(conversation_key(conversation), PARTITIONS)
    undone = Kek(base64.b64decode(cluster.new)).wrap(conversation, "k1", os.urandom(32),
                                                     "default", None, orig=0)
    writer = PlainWriter(cluster.stack.bootstrap, "test-rotation")
    writer.send(ERASURES, *erasure_record(conversation, "default", "test"))
    writer.send(KEYS, key, None, partition)  # the erasure's tombstone, then the run's write
    writer.send(KEYS, key, undone, partition)
    assert writer.flush(30) == []
    rotated = subprocess_cli(cluster.stack, "kek", "rotate", PIPELINE_KEK=cluster.new,
                             PIPELINE_KEK_PREVIOUS=cluster.old)
    assert rotated.returncode == 0, rotated.stderr
    assert "1 erased meanwhile destroyed again" in rotated.stdout, rotated.stdout
    reader = PlainReader(cluster.stack.bootstrap, "test-rotation")
    end = reader.end(KEYS, partition)
    reader.close()
    values = [r.value for r in iter_spans(cluster.stack.bootstrap, KEYS, {partition: (0, end)})
              if r.key == key]
    assert values == [None, undone, None], values


def test_a_rotation_is_finished_by_a_later_run_that_replaced_what_it_did() -> None:
    from pipeline.rotations import Rotation, unfinished

    def run(to: str, replaced: tuple[str, ...], at: int, done: bool) -> Rotation:
        return Rotation(to, replaced, {}, done, at)

    cut = run("n", ("o",), 10, False)
    assert unfinished([cut]) == [cut]
    assert unfinished([cut, run("n", ("o",), 5, True)]) == [cut]  # done before it began
    assert unfinished([cut, run("n", ("o",), 20, True)]) == []
    assert unfinished([cut, run("m", ("n", "o"), 20, True)]) == []  # to another KEK
    assert unfinished([cut, run("m", ("n",), 20, True)]) == [cut]  # o's keys left as they were
    assert unfinished([cut, run("n", ("o",), 20, False)]) == [cut, run("n", ("o",), 20, False)]


def text_of(sse: str) -> str:
    """The content of an SSE stream's chunks."""
    parts = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: "):]).get("choices", ()):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def subprocess_cli(stack: Stack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True,
                          text=True, env=stack.env(**env), timeout=300)




def test_chat_topics_of_different_partition_counts_stop_every_process_at_its_start(
        cluster: Cluster) -> None:
    """Partitions added to one chat topic (here ``chat.live``, after the module's other
    tests) would send a conversation's records and keys to partitions where no reader
    looks for them: every process refuses to start, in one line naming the counts. Added
    to every chat topic alike, they are refused too, by the count the first keyring
    recorded. (Last in the module: its broker keeps the layout.)"""
    from confluent_kafka.admin import AdminClient, NewPartitions

    from pipeline.keylimits import KeyringError
    from pipeline.keystore import open_keyring
    from pipeline.settings import CommonSettings
    from pipeline.topics import PARTITIONED_ALIKE

    cluster.stop()
    # The module's rotation left keys of both KEKs. A start records the layout, if none
    # before it did (this test run alone).
    both = CommonSettings(kafka_bootstrap=cluster.stack.bootstrap, kek=cluster.new,
                          kek_previous=cluster.old)
    open_keyring(both, "layout").close()
    admin = AdminClient({"bootstrap.servers": cluster.stack.bootstrap})
    admin.create_partitions([NewPartitions(LIVE, PARTITIONS + 1)])[LIVE].result(30)
    with pytest.raises(KeyringError, match=rf"{LIVE} has {PARTITIONS + 1}"):
        open_keyring(CommonSettings(kafka_bootstrap=cluster.stack.bootstrap), "layout")
    env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": cluster.stack.bootstrap,
           "DATABASE_URL": cluster.stack.database_url}
    # The gateway's start runs under uvicorn, which would log it as a traceback.
    for command in (["projector"], ["gateway", "--port", str(free_port())]):
        done = subprocess.run([sys.executable, "-m", "launch", *command], env=env,
                              timeout=120, capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"pipeline {command[0]}: the chat topics must have one "
                               f"partition count, and chat.keys has {PARTITIONS} while "
                               f"{LIVE} has {PARTITIONS + 1}"), done.stderr
        assert "Traceback" not in done.stderr, done.stderr

    made = admin.list_topics(timeout=30).topics
    grown = [NewPartitions(t, PARTITIONS + 1) for t in PARTITIONED_ALIKE
             if t != LIVE and t in made]
    for future in admin.create_partitions(grown).values():
        future.result(30)
    with pytest.raises(KeyringError, match=rf"have {PARTITIONS + 1} partitions each, but "
                                           rf"were first used with {PARTITIONS} "):
        open_keyring(CommonSettings(kafka_bootstrap=cluster.stack.bootstrap), "layout")

    # A tombstone on the record (topics made anew, say): the next start records anew.
    from pipeline.kafka.plain import PlainWriter
    from pipeline.layout import layout_count
    from pipeline.rotations import LAYOUT, rotations_and_layout
    from pipeline.topics import ROTATIONS

    writer = PlainWriter(cluster.stack.bootstrap, "reset")
    writer.send(ROTATIONS, LAYOUT, None)
    assert writer.flush(30) == []
    open_keyring(both, "layout").close()
    recorded = rotations_and_layout(cluster.stack.bootstrap, "check")[1]
    assert recorded is not None and layout_count(recorded) == PARTITIONS + 1


def test_a_layout_record_that_holds_no_count_is_read_as_none() -> None:
    from pipeline.codec import Position
    from pipeline.kafka import Record
    from pipeline.layout import layout_count, layout_record

    def record(value: bytes | None) -> Record:
        return Record(Position("chat.rotations", 0, 0), b"layout", value, 0)

    assert layout_count(record(layout_record(6)[1])) == 6
    for value in (None, b"", b"[]", b'{"partitions": 0}', b'{"partitions": true}',
                  b'{"partitions": "6"}', b"\xff", b"[" * 100_000):
        assert layout_count(record(value)) is None, value
