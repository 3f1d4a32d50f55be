"""A secured cluster, as an operator's: a Kafka broker whose clients must use TLS with
SASL/SCRAM (or a client certificate), and a PostgreSQL that takes TLS with a client
certificate only. Every service is connected through the secured listener alone, by
``PIPELINE_KAFKA_CONFIG`` and ``DATABASE_URL``; what they cannot use stops them with one
line naming the listener. The client file's rules and its mapping to faust are checked
without a broker."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import faust
import httpx
import psycopg
import pytest

from infra.kafka_broker import KafkaBroker
from infra.postgres import PostgresServer, debian_bin
from infra.process import free_port
from infra.tls import Authority
from pipeline.kafka import check_access, ensure_topics, set_scram_password, wait_for_broker
from pipeline.kafka import config as kafka_config
from pipeline.kafka.config import AccessRefused, ClientConfigError, read_properties
from pipeline.settings import REPO_ROOT
from pipeline.topics import TopicPolicy, topic_specs
from projections.analytics_app import broker_credentials
from projections.migrate import migrate
from tests.conftest import PARTITIONS, Service, Stack, start_service, wait_healthy
from tests.sse import resume_chat, stream_chat
from workers.sim_engine import sim_token_text

MODEL = "secure-sim"
USER = "pipeline"


def test_the_client_file_is_read_as_kafka_tools_read_it(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    path = tmp_path / "client.properties"
    path.write_text("# a comment\n! another\nsecurity.protocol = SASL_SSL\n"
                    "sasl.mechanism: SCRAM-SHA-512\nsasl.username=app\n"
                    "sasl.password=a=b:c\\\n  d\nssl.ca.location=certs/ca.pem\n"
                    "ssl.key.location=/abs/key.pem\n\n")
    assert read_properties(path) == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "app", "sasl.password": "a=b:cd",  # a value keeps its = and :
        "ssl.ca.location": str(tmp_path / "certs" / "ca.pem"),  # from the file's folder
        "ssl.key.location": "/abs/key.pem"}


def test_a_value_may_come_from_the_environment(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "client.properties"
    path.write_text("sasl.username=app\nsasl.password=${env:KAFKA_PASSWORD}\n")
    monkeypatch.setenv("KAFKA_PASSWORD", "s3cret${env:NOT_AGAIN}")
    assert read_properties(path)["sasl.password"] == "s3cret${env:NOT_AGAIN}"
    monkeypatch.delenv("KAFKA_PASSWORD")
    with pytest.raises(ClientConfigError, match=r":2: \$\{env:KAFKA_PASSWORD\} names a var"):
        read_properties(path)


@pytest.mark.parametrize(("text", "named"), [
    ("acks=1\n", r"client.properties:1: acks is not the file's to set"),
    ("security.protocol=SSL\nisolation.level=read_uncommitted\n",
     r"client.properties:2: isolation.level is not the file's to set"),
    ("bootstrap.servers=x:9092\n", r"PIPELINE_KAFKA_BOOTSTRAP sets it"),
    ("security.protocol\n", r"client.properties:1: expected key=value"),
])
def test_a_file_that_would_weaken_the_pipeline_is_refused_by_line(
        tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "client.properties"
    path.write_text(text)
    with pytest.raises(ClientConfigError, match=named):
        read_properties(path)


def test_the_analytics_consumer_gets_the_same_settings(tmp_path: Path) -> None:
    tls = Authority(tmp_path / "tls").ensure()
    scram = broker_credentials({"security.protocol": "SASL_SSL",
                                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u",
                                "sasl.password": "p", "ssl.ca.location": str(tls.ca)})
    assert isinstance(scram, faust.SASLCredentials)
    assert (scram.username, scram.password, scram.mechanism.value, scram.protocol.value) == (
        "u", "p", "SCRAM-SHA-512", "SASL_SSL")
    assert scram.ssl_context is not None and scram.ssl_context.check_hostname
    mutual = broker_credentials({"security.protocol": "SSL", "ssl.ca.location": str(tls.ca),
                                 "ssl.certificate.location": str(tls.cert(USER)),
                                 "ssl.key.location": str(tls.key(USER))})
    assert isinstance(mutual, faust.SSLCredentials)
    assert broker_credentials({}) is None
    with pytest.raises(ClientConfigError, match=r"sasl\.mechanism OAUTHBEARER"):
        broker_credentials({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"})


def test_every_kafka_client_starts_from_the_operators_settings() -> None:
    """The family of "a client that cannot reach a secured cluster": no client config in
    the code names the cluster's address but through ``client_config``."""
    sources = [p for d in ("gateway", "workers", "projections", "pipeline", "launch", "bench")
               for p in (REPO_ROOT / d).rglob("*.py")]
    offenders = [f"{p.relative_to(REPO_ROOT)}:{n}" for p in sources
                 for n, line in enumerate(p.read_text().splitlines(), start=1)
                 if '"bootstrap.servers"' in line and p.name != "config.py"
                 and "**client_properties()" not in line]
    assert offenders == []


# -- a secured cluster ----------------------------------------------------------------
@dataclass
class Secured:
    tls: Authority
    broker: KafkaBroker
    postgres: PostgresServer
    stack: Stack  # what the services are given: the secured listener and URL only
    sasl_file: Path
    mtls_file: Path

    def client_file(self, path: Path, **changes: str) -> Path:
        props = read_properties(self.sasl_file)
        props.update(changes)
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    home = tmp_path_factory.mktemp("secure")
    tls = Authority(home / "tls").ensure(clients=(USER, "postgres"))
    broker = KafkaBroker(home=home / "kafka", libs=REPO_ROOT / ".state" / "kafka-libs",
                         port=free_port(), controller_port=free_port(), tls=tls,
                         sasl_port=free_port(), mtls_port=free_port())
    # PostgreSQL may run as another OS user: a directory that user can reach.
    pg_home = Path(tempfile.mkdtemp(prefix="pipeline-test-pg-secure-"))
    postgres = PostgresServer(home=pg_home, port=free_port(), database="secure", tls=tls,
                              bin_dir=debian_bin())
    broker.start()
    try:
        postgres.start()
        # The harness sets the cluster up through its PLAINTEXT listener, as an
        # operator's tools would; the services never see it.
        wait_for_broker(broker.bootstrap)
        ensure_topics(broker.bootstrap, topic_specs(TopicPolicy(PARTITIONS), 1))
        password = uuid.uuid4().hex
        set_scram_password(broker.bootstrap, USER, password)
        migrate(postgres.url)
        sasl_file, mtls_file = tls.write_client_files(home, USER, password)
        logs = home / "logs"
        logs.mkdir()
        yield Secured(tls, broker, postgres, Stack(broker.sasl_bootstrap, postgres.url, logs),
                      sasl_file, mtls_file)
    finally:
        postgres.stop()
        broker.stop()
        shutil.rmtree(pg_home, ignore_errors=True)


def test_postgres_takes_tls_with_a_client_certificate_only(secured: Secured) -> None:
    with psycopg.connect(secured.postgres.url) as conn:
        assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
                            ).fetchone() == (True,)
    plain = f"postgresql://postgres@127.0.0.1:{secured.postgres.port}/secure?sslmode=disable"
    with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry"):
        psycopg.connect(plain, connect_timeout=5).close()


def test_a_turn_is_served_stored_resumed_and_counted_over_the_secured_listeners(
        secured: Secured) -> None:
    # Their logs as a log shipper would take them: JSON, one object per line.
    env = {"PIPELINE_KAFKA_CONFIG": str(secured.sasl_file), "PIPELINE_LOG_FORMAT": "json"}
    port, stack = free_port(), secured.stack
    services: list[Service] = [
        start_service(stack, "secure-projector", "projector", "--metrics-port",
                      str(free_port()), **env),
        start_service(stack, "secure-worker", "worker", "--engine", "sim",
                      "--served-model-name", MODEL, "--metrics-port", str(free_port()),
                      WORKER_SIM_TOKENS_PER_S="40", **env),
        start_service(stack, "secure-analytics", "analytics", "--metrics-port",
                      str(free_port()), **env),
        start_service(stack, "secure-gateway", "gateway", "--port", str(port), **env,
                      GATEWAY_MODELS=MODEL),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, services, timeout=90)
        _wait_ready(url, services)
        body = {"model": MODEL, "max_tokens": 40, "user": "secure",
                "messages": [{"role": "user", "content": "over TLS"}]}
        first = stream_chat(url, body, stop_after=3)  # the client goes away mid-turn ...
        assert first.status == 200 and not first.done, first.error
        rest = resume_chat(url, first.request_id, first.last_id)  # ... and comes back
        expected = "".join(sim_token_text(i) for i in range(40))
        assert rest.done and first.text + rest.text == expected
        # The projector stored it and analytics counted it, both through TLS.
        deadline = time.monotonic() + 60
        with psycopg.connect(stack.database_url, autocommit=True) as conn:
            while True:
                stored = conn.execute(
                    "SELECT content FROM messages WHERE request_id = %s AND role = 'assistant'",
                    (first.request_id,)).fetchone()
                counted = conn.execute(
                    "SELECT 1 FROM analytics_turns WHERE request_id = %s",
                    (first.request_id,)).fetchone()
                if stored is not None and counted is not None:
                    break
                assert time.monotonic() < deadline, "\n".join(s.tail() for s in services)
                time.sleep(0.2)
        assert stored == (expected,)
        for service in services:  # none of them fell back to anything else
            assert service.proc.poll() is None, service.tail()
            text = service.log.read_text(errors="replace")
            assert "PLAINTEXT" not in text
            for line in text.splitlines():
                assert isinstance(json.loads(line), dict), (service.name, line)
    finally:
        for service in services:
            service.stop()


def _wait_ready(url: str, services: list[Service]) -> None:
    deadline = time.monotonic() + 90
    while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "\n".join(s.tail() for s in services)
        time.sleep(0.2)


@pytest.mark.parametrize(("case", "changes", "says"), [
    ("a wrong password", {"sasl.password": "wrong"}, r"SASL authentication error"),
    ("an untrusted certificate", {"ssl.ca.location": "OTHER_CA"}, r"certificate verify failed"),
    ("TLS to a plaintext listener", {"PLAINTEXT_PORT": ""}, r"SSL handshake failed"),
])
def test_a_client_the_cluster_refuses_stops_with_one_line_naming_the_listener(
        secured: Secured, tmp_path: Path, case: str, changes: dict[str, str],
        says: str) -> None:
    other = Authority(tmp_path / "other").ensure(clients=())
    changes = {k: (str(other.ca) if v == "OTHER_CA" else v) for k, v in changes.items()}
    bootstrap = secured.broker.sasl_bootstrap
    if changes.pop("PLAINTEXT_PORT", None) is not None:
        bootstrap = secured.broker.bootstrap
    path = secured.client_file(tmp_path / "client.properties", **changes)
    env = secured.stack.env(PIPELINE_KAFKA_CONFIG=str(path), PIPELINE_KAFKA_BOOTSTRAP=bootstrap)
    for command in (["worker", "--engine", "sim", "--metrics-port", str(free_port())],
                    ["projector"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "launch", *command], env=env,
                              capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (case, done.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in done.stderr, (case, done.stderr)
        assert re.search(rf"Kafka refused this client at {re.escape(bootstrap)} \(SASL_SSL, "
                         rf"SCRAM-SHA-512 as user {USER}\): .*{says}", lines[0]), lines[0]
        assert took < 30, f"{case}: {took:.1f} s"


def test_mutual_tls_is_taken_and_a_client_without_a_certificate_is_refused(
        secured: Secured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kafka_config.ENV, str(secured.mtls_file))
    assert check_access(secured.broker.mtls_bootstrap) is True
    bare = tmp_path / "bare.properties"
    bare.write_text(f"security.protocol=SSL\nssl.ca.location={secured.tls.ca}\n")
    monkeypatch.setenv(kafka_config.ENV, str(bare))
    with pytest.raises(AccessRefused, match=r"\(SSL\): .*(alert|certificate)"):
        check_access(secured.broker.mtls_bootstrap)
