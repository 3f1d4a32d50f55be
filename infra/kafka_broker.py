"""Real Apache Kafka brokers in KRaft mode, on 127.0.0.1 or a host address of their own
(each in a network namespace, for the multi-host tests): one combined broker+controller
node (``KafkaBroker``), or a cluster of them (``KafkaCluster``), each node both broker
and controller, with a static quorum of all nodes.

The jars come from Maven Central through ``infra/kafka/pom.xml``; brokers run on the
JDK. A node's data, log and pid file live under its ``home``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infra.process import port_open, read_pid, spawn_daemon, stop_pid, wait_until
from infra.tls import Authority

POM_DIR = Path(__file__).resolve().parent / "kafka"
# About 10 years (docs/deploying.md).
OFFSETS_RETENTION_MINUTES = 5_256_000


def gather_jars(libs: Path, pom: Path = POM_DIR / "pom.xml") -> Path:
    """Download ``pom``'s classpath (the broker's) into ``libs`` once (Maven caches in
    ~/.m2)."""
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise RuntimeError("Maven (mvn) is needed to fetch the Kafka broker from Maven Central")
    libs.mkdir(parents=True, exist_ok=True)
    print(f"gathering the Kafka broker from Maven Central into {libs} ...", flush=True)
    subprocess.run(
        ["mvn", "-q", "-B", "-Dstyle.color=never", "-f", str(pom),
         "dependency:copy-dependencies", f"-DoutputDirectory={libs}"],
        check=True,
    )
    marker.write_text("ok\n")
    return libs


@dataclass
class KafkaBroker:
    home: Path
    libs: Path
    port: int = 9092
    controller_port: int = 9093
    heap: str = "768m"
    node_id: int = 1
    # Its address, and the network namespace it runs in (None: the caller's).
    host: str = "127.0.0.1"
    netns: str | None = None
    # A cluster's static quorum ("1@127.0.0.1:9093,2@..."); None: a standalone node.
    voters: str | None = None
    # Replicas of the broker's own topics (offsets, transactions) and the default for
    # new topics; min.insync.replicas follows (2 with 3 or more replicas).
    replication: int = 1
    cluster_id: str | None = None  # a cluster's nodes are formatted with one id
    # Secured listeners beside PLAINTEXT (which brokers keep between themselves, and the
    # local tools use): SASL_SSL with SCRAM-SHA-512 on ``sasl_port``, and SSL with client
    # certificates (mutual TLS) on ``mtls_port``, both with ``tls``'s server certificate.
    tls: Authority | None = None
    sasl_port: int | None = None
    mtls_port: int | None = None
    # Settings of the broker's own beside these (a test's: a broker that makes topics).
    settings: dict[str, str] = field(default_factory=dict)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        return f"{self.host}:{self.sasl_port}"

    @property
    def mtls_bootstrap(self) -> str:
        return f"{self.host}:{self.mtls_port}"

    def _listeners(self) -> dict[str, str]:
        listeners = {"PLAINTEXT": f"{self.host}:{self.port}"}
        if self.tls is not None:
            listeners.update({"SASL_SSL": f"{self.host}:{self.sasl_port}",
                              "SSL": f"{self.host}:{self.mtls_port}"})
        return listeners

    def _security(self) -> dict[str, str]:
        if self.tls is None:
            return {}
        password = self.tls.keystore_password
        return {
            "inter.broker.listener.name": "PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.tls.keystore("server")),
            "ssl.keystore.password": password,
            "ssl.key.password": password,
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.tls.ca),
            "listener.name.ssl.ssl.client.auth": "required",
        }

    @property
    def pid_file(self) -> Path:
        return self.home / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"

    def _java(self, main: str, *args: str) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("a JDK 17+ (java) is needed to run the Kafka broker")
        return [
            java, f"-Xmx{self.heap}", "-Xms128m", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={POM_DIR / 'log4j2.yaml'}",
            "-cp", f"{self.libs}/*", main, *args,
        ]

    def _write_config(self) -> Path:
        data = self.home / "data"
        replicas, min_isr = str(self.replication), str(2 if self.replication >= 3 else 1)
        quorum = ({"controller.quorum.voters": self.voters} if self.voters else
                  {"controller.quorum.bootstrap.servers": f"{self.host}:{self.controller_port}"})
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            **quorum,
            "listeners": ",".join(f"{n}://{a}" for n, a in self._listeners().items())
            + f",CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": ",".join(f"{n}://{a}"
                                             for n, a in self._listeners().items()),
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": ",".join(
                f"{n}:{n}" for n in self._listeners()) + ",CONTROLLER:PLAINTEXT",
            **self._security(),
            "log.dirs": str(data),
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": "6",
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": min_isr,
            "default.replication.factor": replicas,
            "min.insync.replicas": min_isr,
            # A replica that was not in sync never becomes leader: no acknowledged
            # record is lost to a failover.
            "unclean.leader.election.enable": "false",
            "group.initial.rebalance.delay.ms": "0",
            # A group's committed offsets outlive any stop of its members (Kafka's default
            # drops them 7 days after the last member left: the group would start again
            # at its model's first prompt, or the projector at the log's start).
            "offsets.retention.minutes": str(OFFSETS_RETENTION_MINUTES),
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            **self.settings,
        }
        path = self.home / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def running(self) -> bool:
        return read_pid(self.pid_file) is not None

    def start(self, timeout: float = 90.0) -> None:
        if self.running():
            return
        gather_jars(self.libs)
        self.home.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if not (self.home / "data" / "meta.properties").exists():
            cluster_id = self.cluster_id or self.new_cluster_id()
            mode = [] if self.voters else ["--standalone"]
            subprocess.run(
                self._java("kafka.tools.StorageTool", "format", *mode,
                           "-t", cluster_id, "-c", str(config)),
                check=True, capture_output=True, text=True,
            )
        self.launch()
        self.wait_ready(timeout)

    def new_cluster_id(self) -> str:
        return subprocess.run(
            self._java("kafka.tools.StorageTool", "random-uuid"),
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]

    def launch(self) -> None:
        """Start the broker process (formatted already); ``wait_ready`` waits for it."""
        config = self._write_config()
        inside = ["ip", "netns", "exec", self.netns] if self.netns else []
        self._proc = spawn_daemon(inside + self._java("kafka.Kafka", str(config)),
                                  self.log_file, self.pid_file)

    def wait_ready(self, timeout: float = 90.0) -> None:
        ports = [self.port] + ([self.sasl_port or 0, self.mtls_port or 0] if self.tls else [])
        wait_until(lambda: self.running() and all(port_open(p, self.host) for p in ports),
                   timeout,
                   f"Kafka broker on {self.bootstrap}", self.log_file)

    @property
    def pid(self) -> int | None:
        return read_pid(self.pid_file)

    def stop(self) -> None:
        pid = read_pid(self.pid_file)
        if pid is not None:
            stop_pid(pid, timeout=30)
        if self._proc is not None:
            self._proc.wait()  # reap our child
            self._proc = None
        self.pid_file.unlink(missing_ok=True)


@dataclass
class KafkaCluster:
    """``size`` nodes on 127.0.0.1, node i (from 1) on ports ``port + 2(i-1)`` (clients)
    and the next (controller). One node keeps the standalone layout."""

    home: Path
    libs: Path
    port: int = 9092
    size: int = 1
    heap: str = "768m"
    ports: list[tuple[int, int]] | None = None  # (client, controller) per node, if not derived
    # With an authority, every node also listens with SASL_SSL (SCRAM) on its client
    # port + 100, and with mutual TLS on the next port (KafkaBroker).
    tls: Authority | None = None
    # Node i's address and network namespace (a host of its own), if not 127.0.0.1.
    hosts: list[tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        ports = self.ports or [(self.port + 2 * i, self.port + 2 * i + 1)
                               for i in range(self.size)]
        # Node i's secured listeners: its client port + 100 and + 101 (with an authority).
        sasl = [p + 100 if self.tls else None for p, _ in ports]
        mtls = [p + 101 if self.tls else None for p, _ in ports]
        if self.size == 1:
            self.nodes = [KafkaBroker(home=self.home, libs=self.libs, port=ports[0][0],
                                      controller_port=ports[0][1], heap=self.heap,
                                      tls=self.tls, sasl_port=sasl[0], mtls_port=mtls[0])]
            return
        hosts = self.hosts or [("127.0.0.1", "")] * self.size
        voters = ",".join(f"{i + 1}@{hosts[i][0]}:{c}" for i, (_, c) in enumerate(ports))
        self.nodes = [KafkaBroker(home=self.home / f"node-{i + 1}", libs=self.libs,
                                  port=p, controller_port=c, heap=self.heap, node_id=i + 1,
                                  voters=voters, replication=min(3, self.size),
                                  host=hosts[i][0], netns=hosts[i][1] or None,
                                  tls=self.tls, sasl_port=sasl[i], mtls_port=mtls[i])
                      for i, (p, c) in enumerate(ports)]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def sasl_bootstrap(self) -> str:
        return ",".join(node.sasl_bootstrap for node in self.nodes)

    @property
    def mtls_bootstrap(self) -> str:
        return ",".join(node.mtls_bootstrap for node in self.nodes)

    def start(self, timeout: float = 120.0) -> None:
        if self.size == 1:
            self.nodes[0].start(timeout)
            return
        gather_jars(self.libs)
        id_file = self.home / "cluster.id"
        self.home.mkdir(parents=True, exist_ok=True)
        if not id_file.exists():
            id_file.write_text(self.nodes[0].new_cluster_id())
        for node in self.nodes:
            node.cluster_id = id_file.read_text().strip()
        # The quorum needs a majority up: start every node, then wait for them all.
        for node in self.nodes:
            if not node.running():
                node.home.mkdir(parents=True, exist_ok=True)
                if not (node.home / "data" / "meta.properties").exists():
                    subprocess.run(
                        node._java("kafka.tools.StorageTool", "format", "-t",
                                   node.cluster_id or "", "-c", str(node._write_config())),
                        check=True, capture_output=True, text=True)
                node.launch()
        for node in self.nodes:
            node.wait_ready(timeout)

    def running(self) -> list[bool]:
        return [node.running() for node in self.nodes]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
