"""Many hosts, and the faults only a network makes. Network namespaces on this machine
stand for hosts, each with an address of its own on a bridge: three brokers (a KRaft
cluster, replication 3, min.insync.replicas 2), two gateways, two SIMULATED-engine
workers, the projector and PostgreSQL; the test's clients are on the bridge's own
address. No component reaches another through 127.0.0.1.

Under the outage suite's streaming load (its clients and its checker:
``tests/test_outages.py``), with packet filters in a host's namespace:
(a) a worker partitioned from the brokers for 30 s while it generates (it keeps running
and keeps trying to write), then healed; (b) a gateway cut off from the brokers
mid-stream for 15 s; (c) the leader broker of a busy partition isolated from its peers
for 20 s (clients still reach it); (d) 5% of packets lost between the gateways and the
brokers for 20 s. This machine's kernel has no netem (``CONFIG_NET_SCH_NETEM`` is off),
so the 100 ms latency the issue asks for with that loss cannot be injected here: loss
only. The checker requires what it requires of every outage: every turn answered 2xx
complete, gap-free and stored once as the client saw it, no turn answered 5xx ever
written or run, the store equal to a replay. The figures go to ``outages.json`` in the
module's logs and to the terminal.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.kafka_broker import KafkaCluster
from infra.postgres import PostgresServer
from pipeline.settings import REPO_ROOT
from pipeline.topics import GENERATIONS
from tests.conftest import PARTITIONS, Service, Stack, start_service
from tests.netns import Network
from tests.sse import scrape
from tests.test_outages import (
    ACCEPT_TIMEOUT_S,
    DEPENDENCY_TIMEOUT_S,
    MODEL,
    RATE,
    Fleet,
    running,
    under_load,
)

pytestmark = pytest.mark.integration

BROKERS = ["kafka-1", "kafka-2", "kafka-3"]
HOSTS = {"kafka-1": 11, "kafka-2": 12, "kafka-3": 13, "gateway-1": 21, "gateway-2": 22,
         "worker-1": 31, "worker-2": 32, "projector": 41, "postgres": 51}
GATEWAY_PORT = 8000
METRICS_PORT = 9100


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    network = Network(HOSTS).up()
    try:
        yield network
    finally:
        network.down()


@pytest.fixture(scope="module")
def hosts(net: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Each broker on a host of its own: the same ports on every one.
    cluster = KafkaCluster(home=tmp_path_factory.mktemp("kafka-hosts"),
                           libs=REPO_ROOT / ".state" / "kafka-libs", size=3, heap="512m",
                           ports=[(9092, 9093)] * 3,
                           hosts=[(net.address(b), net.namespace(b)) for b in BROKERS])
    pg_home = Path(tempfile.mkdtemp(prefix="pipeline-test-pg-hosts-"))
    postgres = PostgresServer(home=pg_home, port=5432, database="hosts",
                              host=net.address("postgres"), netns=net.namespace("postgres"))

    def start(stack: Stack) -> tuple[dict[str, Service], tuple[str, ...]]:
        services = {}
        for i in (1, 2):
            services[f"worker-{i}"] = start_service(
                stack, f"hosts-worker-{i}", "worker", "--engine", "sim", "--max-num-seqs",
                "16", "--metrics-port", str(METRICS_PORT), inside=net.inside(f"worker-{i}"),
                WORKER_SERVED_MODEL_NAME=MODEL, WORKER_SIM_TOKENS_PER_S=str(RATE),
                PIPELINE_METRICS_HOST="0.0.0.0")
            services[f"gateway-{i}"] = start_service(
                stack, f"hosts-gateway-{i}", "gateway", "--port", str(GATEWAY_PORT),
                inside=net.inside(f"gateway-{i}"), GATEWAY_HOST=net.address(f"gateway-{i}"),
                GATEWAY_MODELS=MODEL, GATEWAY_ACCEPT_TIMEOUT_S=str(ACCEPT_TIMEOUT_S),
                GATEWAY_DEPENDENCY_TIMEOUT_S=str(DEPENDENCY_TIMEOUT_S))
        services["projector"] = start_service(stack, "hosts-projector", "projector",
                                              inside=net.inside("projector"))
        return services, tuple(f"http://{net.address(g)}:{GATEWAY_PORT}"
                               for g in ("gateway-1", "gateway-2"))

    with running(cluster, postgres, pg_home, tmp_path_factory.mktemp("hosts-logs"),
                 start) as fleet:
        yield fleet


def test_every_component_is_on_a_host_of_its_own(hosts: Fleet, net: Network) -> None:
    """Nothing reaches another component through loopback: the brokers advertise their
    hosts' addresses, and the services' settings name them."""
    assert all(not a.startswith("127.") for a in hosts.stack.bootstrap.split(","))
    assert net.address("postgres") in hosts.stack.database_url
    for service in hosts.services.values():
        args = service.proc.args
        assert isinstance(args, list) and args[:3] == ["ip", "netns", "exec"], args


def owned(net: Network, worker: str) -> float:
    """The partitions ``worker`` says it owns (its /metrics, reached over the bridge)."""
    return scrape(f"http://{net.address(worker)}:{METRICS_PORT}/metrics").get(
        "worker_assigned_partitions", 0.0)


def test_a_worker_partitioned_from_the_brokers_for_30_s(hosts: Fleet, net: Network) -> None:
    """It runs on through the partition (generating, trying to write); its group hands
    its partitions to the other worker once its session runs out, and takes it back
    once healed. Nothing it wrote meanwhile reaches a reader (the checker)."""
    seen: dict[str, float] = {}

    def partition() -> None:
        net.cut("worker-1", BROKERS)
        cut = time.monotonic()
        try:
            while owned(net, "worker-2") < PARTITIONS:
                assert time.monotonic() - cut < 30, "worker-2 never took the partitions"
                time.sleep(0.2)
            seen["partitions moved after s"] = round(time.monotonic() - cut, 1)
            time.sleep(max(30 - (time.monotonic() - cut), 0))
        finally:
            net.heal("worker-1")
        healed = time.monotonic()
        while owned(net, "worker-1") < 1:
            assert time.monotonic() - healed < 60, "worker-1 never rejoined"
            time.sleep(0.2)
        seen["rejoined after heal s"] = round(time.monotonic() - healed, 1)

    report = under_load(hosts, "net: worker partitioned 30 s", partition)
    print(json.dumps({**report, **seen}))
    assert hosts.services["worker-1"].proc.poll() is None  # it ran through it


def test_a_gateway_cut_off_from_the_brokers_mid_stream(hosts: Fleet, net: Network) -> None:
    def cut_off() -> None:
        net.cut("gateway-1", BROKERS)
        try:
            time.sleep(15)
        finally:
            net.heal("gateway-1")

    # A prompt whose commit was asked as the cut began is answered when the brokers are
    # heard again (it may have been written), not before: up to the cut's length.
    under_load(hosts, "net: gateway cut off 15 s", cut_off, frozen_s=15)


def test_the_leader_of_a_busy_partition_isolated_from_its_peers(
        hosts: Fleet, net: Network) -> None:
    def isolate() -> None:
        leader = f"kafka-{hosts.leader(GENERATIONS, 0)}"
        peers = [b for b in BROKERS if b != leader]
        net.cut(leader, peers)
        for peer in peers:
            net.cut(peer, [leader])
        try:
            time.sleep(20)
        finally:
            for broker in BROKERS:
                net.heal(broker)

    # Its transactions wait for it: a prompt whose commit it held is answered after.
    under_load(hosts, "net: leader isolated 20 s", isolate, frozen_s=20)
    hosts.wait_fully_replicated()


def test_packet_loss_between_the_gateways_and_the_brokers(hosts: Fleet, net: Network) -> None:
    def lossy() -> None:
        for gateway in ("gateway-1", "gateway-2"):
            net.cut(gateway, BROKERS, loss=0.05)
        try:
            time.sleep(20)
        finally:
            for gateway in ("gateway-1", "gateway-2"):
                net.heal(gateway)

    under_load(hosts, "net: 5% loss gateways-brokers 20 s", lossy)
