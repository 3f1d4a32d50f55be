"""The local stack: Kafka (one node, or a cluster) and a PostgreSQL server on 127.0.0.1,
with the topics and migrations the pipeline needs (``pipeline infra up|down|status``).

The cluster's size is remembered in its state directory, so ``status`` and ``down``
need no flag; ``up --brokers N`` on a state made with another size refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeline.settings import CommonSettings


@dataclass(frozen=True)
class Started:
    """What an ``infra_up`` started itself: not what was running already."""

    kafka: bool
    postgres: bool


def _kafka_port(bootstrap: str) -> int:
    return int(bootstrap.split(",")[0].rsplit(":", 1)[1])


def _size(common: CommonSettings, asked: int | None) -> int:
    marker = common.state_dir / "kafka" / "cluster.json"
    known = json.loads(marker.read_text())["brokers"] if marker.exists() else None
    if asked is not None and known is not None and asked != known:
        raise SystemExit(f"the Kafka state under {marker.parent} is a {known}-node cluster; "
                         f"`pipeline infra down` and remove it (make clean-state) to "
                         f"start {asked} nodes")
    return asked or known or common.brokers


def _local_stack(common: CommonSettings, brokers: int | None = None,
                 secure: bool = False) -> tuple[Any, Any]:
    from urllib.parse import urlparse

    from infra.kafka_broker import KafkaCluster
    from infra.postgres import PostgresServer
    from infra.tls import Authority

    state = common.state_dir
    tls = Authority(state / "kafka" / "tls").ensure() if secure else None
    cluster = KafkaCluster(home=state / "kafka", libs=state / "kafka-libs",
                           port=_kafka_port(common.kafka_bootstrap),
                           size=_size(common, brokers), tls=tls)
    url = urlparse(common.database_url)
    postgres = PostgresServer(home=state / "postgres", port=url.port or 5432,
                              database=(url.path or "/pipeline").lstrip("/") or "pipeline")
    return cluster, postgres


def infra_up(common: CommonSettings, external_db: bool, brokers: int | None = None,
             secure: bool = False) -> Started:
    from pipeline.kafka import broker_count, ensure_topics, wait_for_broker
    from pipeline.topics import topic_specs
    from projections.migrate import migrate

    cluster, postgres = _local_stack(common, brokers, secure)
    started = Started(kafka=not all(cluster.running()),
                      postgres=not external_db and not postgres.running())
    print(f"Kafka      {cluster.bootstrap}  ({cluster.size} node{'s' * (cluster.size > 1)},"
          f" data in {cluster.home})", flush=True)
    cluster.start()
    (cluster.home / "cluster.json").write_text(json.dumps({"brokers": cluster.size}))
    wait_for_broker(cluster.bootstrap)
    specs = topic_specs(common.topic_policy(), broker_count(cluster.bootstrap))
    created = ensure_topics(cluster.bootstrap, specs)
    if created:
        print(f"topics     created {', '.join(created)} (replication {specs[0].replication}, "
              f"{specs[0].config['min.insync.replicas']} in sync)", flush=True)
    if cluster.size > 1:
        print(f"           clients: PIPELINE_KAFKA_BOOTSTRAP={cluster.bootstrap}", flush=True)
    if secure:
        _secure_clients(cluster)
    if external_db:
        print("PostgreSQL using DATABASE_URL", flush=True)
    else:
        print(f"PostgreSQL 127.0.0.1:{postgres.port}  (data in {postgres.home})", flush=True)
        postgres.start()
    applied = migrate(common.database_url)
    print(f"migrations {'applied ' + ', '.join(applied) if applied else 'up to date'}",
          flush=True)
    return started


SCRAM_USER = "pipeline"


def _secure_clients(cluster: Any) -> None:
    """The secured listeners' SCRAM user and client files: ``client.properties``
    (SASL_SSL, SCRAM-SHA-512) and ``client-mtls.properties`` (a client certificate)."""
    import secrets

    from pipeline.kafka import set_scram_password

    tls = cluster.tls
    secret = tls.home / "scram.password"
    if not secret.exists():
        secret.write_text(secrets.token_urlsafe(18) + "\n")
        secret.chmod(0o600)
    set_scram_password(cluster.bootstrap, SCRAM_USER, secret.read_text().strip())
    sasl, mtls = tls.write_client_files(
        cluster.home, SCRAM_USER, secret.read_text().strip(),
        comment=f"# Kafka client settings for the local cluster's secured listeners (SASL_SSL "
                f"{cluster.sasl_bootstrap}, mutual TLS {cluster.mtls_bootstrap})\n")
    print(f"secured    SASL_SSL {cluster.sasl_bootstrap} (SCRAM-SHA-512, user {SCRAM_USER}),"
          f" SSL {cluster.mtls_bootstrap} (client certificates); CA {tls.ca}\n"
          f"           clients: PIPELINE_KAFKA_BOOTSTRAP={cluster.sasl_bootstrap} "
          f"PIPELINE_KAFKA_CONFIG={sasl}\n"
          f"           or:      PIPELINE_KAFKA_BOOTSTRAP={cluster.mtls_bootstrap} "
          f"PIPELINE_KAFKA_CONFIG={mtls}", flush=True)


def infra_down(common: CommonSettings, only: Started | None = None) -> None:
    """Stop the local stack; ``only``: just what one ``infra_up`` started (a demo leaves
    running what was running before it, another demo's or ``pipeline infra up``'s)."""
    cluster, postgres = _local_stack(common)
    only = only or Started(kafka=True, postgres=True)
    if only.kafka:
        cluster.stop()
    if only.postgres:
        postgres.stop()
    parts = (("Kafka", only.kafka), ("PostgreSQL", only.postgres))
    stopped = [name for name, did in parts if did]
    left = [name for name, did in parts if not did]
    if stopped:
        print(f"stopped {' and '.join(stopped)} (data kept under .state/)")
    if left:
        print(f"left {' and '.join(left)} running: it was running before this started "
              "(`pipeline infra down` stops it)")


def infra_status(common: CommonSettings, external_db: bool) -> int:
    cluster, postgres = _local_stack(common)
    up = cluster.running()
    for node, running in zip(cluster.nodes, up, strict=True):
        label = f"kafka {node.node_id}" if cluster.size > 1 else "kafka"
        print(f"{label:<10} {'running' if running else 'stopped'}  {node.bootstrap}"
              + (f"  pid {node.pid}" if running else ""))
    pg_up = True if external_db else postgres.running()
    print(f"postgres   {'running' if pg_up else 'stopped'}  "
          f"{'DATABASE_URL' if external_db else f'127.0.0.1:{postgres.port}'}")
    return 0 if all(up) and pg_up else 1
