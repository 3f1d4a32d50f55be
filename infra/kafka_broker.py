"""A real Apache Kafka broker in KRaft mode (one combined broker+controller node) on 127.0.0.1.

The jars come from Maven Central through ``infra/kafka/pom.xml``; the broker runs on
the JDK. Data, logs and the pid file live under ``home``.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infra.process import port_open, read_pid, spawn_daemon, stop_pid, wait_until

POM_DIR = Path(__file__).resolve().parent / "kafka"


def gather_jars(libs: Path) -> Path:
    """Download the broker's classpath into ``libs`` once (Maven caches in ~/.m2)."""
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise RuntimeError("Maven (mvn) is needed to fetch the Kafka broker from Maven Central")
    libs.mkdir(parents=True, exist_ok=True)
    print(f"gathering the Kafka broker from Maven Central into {libs} ...", flush=True)
    subprocess.run(
        ["mvn", "-q", "-B", "-Dstyle.color=never", "-f", str(POM_DIR / "pom.xml"),
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
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

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
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(data),
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "6",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
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
            cluster_id = subprocess.run(
                self._java("kafka.tools.StorageTool", "random-uuid"),
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]
            subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "--standalone",
                           "-t", cluster_id, "-c", str(config)),
                check=True, capture_output=True, text=True,
            )
        self._proc = spawn_daemon(self._java("kafka.Kafka", str(config)), self.log_file,
                                  self.pid_file)
        wait_until(lambda: self.running() and port_open(self.port), timeout,
                   f"Kafka broker on {self.bootstrap}", self.log_file)

    def stop(self) -> None:
        pid = read_pid(self.pid_file)
        if pid is not None:
            stop_pid(pid, timeout=30)
        if self._proc is not None:
            self._proc.wait()  # reap our child
            self._proc = None
        self.pid_file.unlink(missing_ok=True)
