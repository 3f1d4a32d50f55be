"""The local stack: a Kafka broker and a PostgreSQL server on 127.0.0.1, with the topics
and migrations the pipeline needs (``pipeline infra up|down|status``)."""

from __future__ import annotations

from typing import Any

from pipeline.settings import CommonSettings


def _kafka_port(bootstrap: str) -> int:
    return int(bootstrap.rsplit(":", 1)[1])


def _local_stack(common: CommonSettings) -> tuple[Any, Any]:
    from urllib.parse import urlparse

    from infra.kafka_broker import KafkaBroker
    from infra.postgres import PostgresServer

    state = common.state_dir
    port = _kafka_port(common.kafka_bootstrap)
    broker = KafkaBroker(home=state / "kafka", libs=state / "kafka-libs", port=port,
                         controller_port=port + 1)
    url = urlparse(common.database_url)
    postgres = PostgresServer(home=state / "postgres", port=url.port or 5432,
                              database=(url.path or "/pipeline").lstrip("/") or "pipeline")
    return broker, postgres


def infra_up(common: CommonSettings, external_db: bool) -> None:
    from pipeline.kafka import ensure_topics, wait_for_broker
    from pipeline.topics import topic_specs
    from projections.migrate import migrate

    broker, postgres = _local_stack(common)
    print(f"Kafka      {common.kafka_bootstrap}  (data in {broker.home})", flush=True)
    broker.start()
    wait_for_broker(common.kafka_bootstrap)
    created = ensure_topics(common.kafka_bootstrap, topic_specs(common.partitions))
    if created:
        print(f"topics     created {', '.join(created)}", flush=True)
    if external_db:
        print("PostgreSQL using DATABASE_URL", flush=True)
    else:
        print(f"PostgreSQL 127.0.0.1:{postgres.port}  (data in {postgres.home})", flush=True)
        postgres.start()
    applied = migrate(common.database_url)
    print(f"migrations {'applied ' + ', '.join(applied) if applied else 'up to date'}",
          flush=True)


def infra_down(common: CommonSettings) -> None:
    broker, postgres = _local_stack(common)
    broker.stop()
    postgres.stop()
    print("stopped Kafka and PostgreSQL (data kept under .state/)")


def infra_status(common: CommonSettings, external_db: bool) -> int:
    broker, postgres = _local_stack(common)
    kafka_up = broker.running()
    pg_up = True if external_db else postgres.running()
    print(f"kafka      {'running' if kafka_up else 'stopped'}  {common.kafka_bootstrap}")
    print(f"postgres   {'running' if pg_up else 'stopped'}  "
          f"{'DATABASE_URL' if external_db else f'127.0.0.1:{postgres.port}'}")
    return 0 if kafka_up and pg_up else 1
