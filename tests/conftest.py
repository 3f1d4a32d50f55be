"""Session fixtures: a real Kafka broker and a real PostgreSQL on free ports, started once,
and the pipeline's processes (projector, vLLM worker, gateway) run as in production."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
from psycopg import sql

from infra.kafka_broker import KafkaBroker
from infra.postgres import PostgresServer
from infra.process import free_port
from pipeline.kafka import ensure_topics, wait_for_broker
from pipeline.keystore import open_keyring
from pipeline.settings import REPO_ROOT, CommonSettings
from pipeline.topics import STORE_TOPICS, TopicPolicy, TopicSpec, topic_specs
from projections.migrate import migrate
from tests.logread import end_offsets, hold

PARTITIONS = 3
MODEL = "tiny-random-llama"


@dataclass
class Stack:
    bootstrap: str
    database_url: str
    logs: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "PIPELINE_KAFKA_BOOTSTRAP": self.bootstrap,
            "DATABASE_URL": self.database_url,
            "PIPELINE_PARTITIONS": str(PARTITIONS),
            "PIPELINE_LOG_LEVEL": "INFO",
        })
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("kafka")
    broker = KafkaBroker(home=home, libs=REPO_ROOT / ".state" / "kafka-libs",
                         port=free_port(), controller_port=free_port())
    # PostgreSQL may run as another OS user: give it a directory that user can reach.
    pg_home = Path(tempfile.mkdtemp(prefix="pipeline-test-pg-"))
    postgres = PostgresServer(home=pg_home, port=free_port(), database="pipeline_test")
    broker.start()
    try:
        postgres.start()
        wait_for_broker(broker.bootstrap)
        ensure_topics(broker.bootstrap, topic_specs(TopicPolicy(PARTITIONS), 1))
        migrate(postgres.url)
        # The tests read content from the log as the services do: with its data keys.
        with hold(broker.bootstrap, open_keyring(
                CommonSettings(kafka_bootstrap=broker.bootstrap), "tests")) as keyring, \
                keyring:
            yield Stack(broker.bootstrap, postgres.url, tmp_path_factory.mktemp("logs"))
    finally:
        postgres.stop()
        broker.stop()
        shutil.rmtree(pg_home, ignore_errors=True)


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the service and every process it started (vLLM's engine processes)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_service(stack: Stack, name: str, *args: str, inside: Sequence[str] = (),
                  **env: str) -> Service:
    """``pipeline *args`` as its own process (``inside``: on another host, as
    ``ip netns exec NS`` runs it; it execs, so the pid is the service's)."""
    log = stack.logs / f"{name}-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        # Its own process group: a crash test kills the service with all its children,
        # as a container runtime or systemd does.
        proc = subprocess.Popen([*inside, sys.executable, "-m", "launch", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=stack.env(**env),
                                start_new_session=True)
    return Service(name, proc, log)


@dataclass
class Pipeline:
    stack: Stack
    url: str
    services: dict[str, Service] = field(default_factory=dict)
    worker_metrics: str = ""

    def logs(self) -> str:
        return "\n".join(s.tail() for s in self.services.values())

    def wait_projected(self, timeout: float = 60) -> None:
        """Until the projector's stored positions reach the current end of its topics."""
        wait_projected(self.stack, timeout)


def wait_projected(stack: Stack, timeout: float = 60) -> None:
    """Until the projector's stored positions reach the current end of its topics."""
    ends = {(t, p): o for t in STORE_TOPICS
            for p, o in end_offsets(stack.bootstrap, t).items() if o > 0}
    deadline = time.monotonic() + timeout
    with psycopg.connect(stack.database_url, autocommit=True) as conn:
        while True:
            stored = {(t, p): o for t, p, o in conn.execute(
                "SELECT topic, partition, next_offset FROM projector_positions")}
            if all(stored.get(tp, 0) >= end for tp, end in ends.items()):
                return
            assert time.monotonic() < deadline, f"projection stuck: {stored} < {ends}"
            time.sleep(0.05)


def wait_healthy(url: str, services: list[Service], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for s in services:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}\n{s.tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy\n" + "\n".join(s.tail() for s in services))


def idempotent_conversation(key: str, tenant: str = "default") -> uuid.UUID:
    """The conversation a request with this Idempotency-Key starts, as the test stack's
    gateways derive it (keyed by the stack's KEK: ``pipeline.digests``)."""
    from gateway.ids import idempotent_conversation as derived
    from pipeline.digests import Digester
    from pipeline.kek import load_kek

    return derived(Digester(load_kek(CommonSettings())).raw("idempotency", tenant, key))


def new_database(database_url: str, name: str) -> str:
    admin = database_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return database_url.rsplit("/", 1)[0] + f"/{name}"


def at_once(start: Callable[[], object], times: int) -> list[Exception]:
    """Call ``start`` on ``times`` threads at once (processes of a stack starting
    together); what the calls raised."""
    failed: list[Exception] = []

    def run() -> None:
        try:
            start()
        except Exception as exc:
            failed.append(exc)

    threads = [threading.Thread(target=run) for _ in range(times)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return failed


@contextlib.contextmanager
def own_broker(tmp_path_factory: pytest.TempPathFactory, name: str,
               specs: list[TopicSpec] | None = None, **settings: str) -> Iterator[str]:
    """A broker of a module's own (``settings``: of the broker's, beside the usual), with
    these topics made (the pipeline's by default): its bootstrap."""
    broker = KafkaBroker(home=tmp_path_factory.mktemp(f"kafka-{name}"),
                         libs=REPO_ROOT / ".state" / "kafka-libs",
                         port=free_port(), controller_port=free_port(), settings=settings)
    broker.start()
    try:
        wait_for_broker(broker.bootstrap)
        ensure_topics(broker.bootstrap,
                      topic_specs(TopicPolicy(PARTITIONS), 1) if specs is None else specs)
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def sim_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A second broker and database for the SIMULATED engine's load and fault tests, so
    their workers never share a group with the vLLM worker. Each module starts the
    processes it needs on it."""
    with own_broker(tmp_path_factory, "sim") as bootstrap:
        database_url = new_database(stack.database_url, "sim")
        migrate(database_url)
        with hold(bootstrap, open_keyring(
                CommonSettings(kafka_bootstrap=bootstrap), "tests-sim")) as keyring, keyring:
            yield Stack(bootstrap, database_url, stack.logs)


@pytest.fixture(scope="session")
def pipeline(stack: Stack) -> Iterator[Pipeline]:
    """Projector, vLLM worker (tiny local model) and gateway, each its own process."""
    port, worker_metrics = free_port(), free_port()
    services = {
        "projector": start_service(stack, "projector", "projector"),
        "worker": start_service(stack, "worker", "worker", "--max-num-seqs", "16",
                                "--metrics-port", str(worker_metrics)),
        # Re-attaching tests must beat the grace period; cancellation on disconnect is
        # tested on gateways of its own.
        "gateway": start_service(stack, "gateway", "gateway", "--port", str(port),
                                 GATEWAY_CANCEL_GRACE_S="5"),
    }
    p = Pipeline(stack, f"http://127.0.0.1:{port}", services,
                 worker_metrics=f"http://127.0.0.1:{worker_metrics}/metrics")
    try:
        wait_healthy(p.url, list(services.values()), timeout=60)
        # Warm up: one turn through every component proves the worker's engine is up.
        try:
            r = httpx.post(f"{p.url}/v1/chat/completions", timeout=300, json={
                "model": MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "warm up"}]})
        except httpx.HTTPError as exc:
            raise RuntimeError(f"warm-up failed: {exc}\n{p.logs()}") from exc
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{p.logs()}"
        yield p
    finally:
        for s in services.values():
            s.stop()
