"""``pipeline``, the command line: its arguments (``launch.parser``, whose text
``pipeline --help`` prints), and what runs each command: the services here, the
operator's one-shot commands in ``launch.admin``, bench and fuzz in ``launch.tools``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gateway.settings import GatewaySettings
from launch.admin import (
    run_audit_command,
    run_erase_command,
    run_kek_command,
    run_keys_command,
    run_replay_command,
    run_rollout_command,
    run_topics_command,
    run_usage_command,
)
from launch.parser import parser
from launch.services import run_analytics, run_gateway, run_memory, run_projector, run_worker
from launch.tools import run_bench_command, run_fuzz_command
from memory.settings import MemorySettings
from pipeline.kafka.client import name_clients
from pipeline.kafka.config import AccessRefused, ClientConfigError
from pipeline.keylimits import KeyringError
from pipeline.logs import log_format, setup_logging
from pipeline.retry import Backoff, RepeatFilter
from pipeline.settings import CommonSettings
from projections.migrate import MigrationError
from projections.settings import AnalyticsSettings, ProjectorSettings
from workers.engine import EngineSettingsRefused
from workers.settings import WorkerSettings


def _setup_logging() -> None:
    setup_logging(os.environ.get("PIPELINE_LOG_LEVEL", "INFO"), log_format())
    # The connection pool logs each failed attempt to reach a database that is away:
    # once per 30 s per kind of failure is enough.
    logging.getLogger("psycopg.pool").addFilter(RepeatFilter(every_s=30.0))
    # httpx logs every request at INFO with its whole URL: a gateway's call to the memory
    # service names its end user in the query (the marker test found it in the log).
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _overrides(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, and no traceback
        print(f"pipeline {args.command}: interrupted", file=sys.stderr)
        return 130


def _main(args: argparse.Namespace) -> int:
    _setup_logging()
    name_clients(args.command)  # the broker tells this process's clients apart by it
    common = CommonSettings()
    external_db = "DATABASE_URL" in os.environ
    if args.command in ONE_SHOT:
        # A one-shot command ends with its answer or one line saying which service did
        # not answer; the Kafka client's log of each retry until then says no more.
        for name in ("librdkafka", "pipeline.kafka"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    # A setup step's commands (topics, migrate) may wait for their service (``--wait``):
    # both are idempotent, so each try runs the whole command again.
    deadline = time.monotonic() + getattr(args, "wait", 0.0)
    backoff = Backoff(first_s=0.5, max_s=5.0)
    said = -float("inf")
    while True:
        try:
            return _attempt(args, common, external_db)
        except ServiceDown as down:
            now = time.monotonic()
            if now >= deadline:
                print(f"pipeline {args.command}: {down}", file=sys.stderr)
                return 3
            if now - said >= 10:
                said = now
                print(f"pipeline {args.command}: {down}; trying again for "
                      f"{deadline - now:.0f} s more", file=sys.stderr, flush=True)
            time.sleep(min(backoff.next(), deadline - now))


class ServiceDown(Exception):
    """A service the command needs does not answer (its one line: ``service_down``)."""


def _attempt(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    try:
        if args.command in KAFKA_COMMANDS:
            _check_kafka_access(common)
        return _run(args, common, external_db)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"pipeline {args.command}: {exc.strerror} (address in use: is another "
              "one running?)", file=sys.stderr)
        return 2
    except (AccessRefused, ClientConfigError, MigrationError, EngineSettingsRefused) as exc:
        print(f"pipeline {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        down = service_down(exc, common, external_db)
        if down is not None:
            raise ServiceDown(down) from None
        if isinstance(exc, KeyringError):  # the log's keys or layout refuse this process
            print(f"pipeline {args.command}: {exc}", file=sys.stderr)
            return 2
        raise


ONE_SHOT = {"migrate", "topics", "keys", "replay", "audit", "usage", "rollout", "erase",
            "kek"}
# What talks to Kafka: it is refused at once if the cluster will not let it in.
KAFKA_COMMANDS = {"gateway", "worker", "projector", "analytics", "memory", "topics", "keys",
                  "replay", "audit", "rollout", "erase", "kek"}


def _check_kafka_access(common: CommonSettings) -> None:
    """Stops the command (AccessRefused, one line) if the cluster refuses this process's
    clients; a cluster that does not answer yet is the services' to wait for."""
    from pipeline.kafka import check_access

    check_access(common.kafka_bootstrap)


def service_down(exc: Exception, common: CommonSettings, external_db: bool) -> str | None:
    """One line for a command that needed a service that does not answer, or None."""
    import psycopg

    from pipeline.kafka import unreachable

    if isinstance(exc, psycopg.OperationalError):
        if external_db:
            return ("PostgreSQL does not answer at DATABASE_URL "
                    f"({str(exc).splitlines()[0]}); start that server, or unset "
                    "DATABASE_URL and run `pipeline infra up`")
        info = psycopg.conninfo.conninfo_to_dict(common.database_url)
        return (f"PostgreSQL does not answer at {info.get('host')}:{info.get('port', 5432)}; "
                "`pipeline infra up` starts it")
    if unreachable(exc) or getattr(exc, "unreachable", False) is True:  # KeyringError
        return (f"Kafka does not answer at {common.kafka_bootstrap}; "
                "`pipeline infra up` starts it")
    return None


def _infra(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    from launch.local import infra_down, infra_status, infra_up

    if args.action == "up":
        infra_up(common, external_db, args.brokers, args.secure)
    elif args.action == "down":
        infra_down(common)
    else:
        return infra_status(common, external_db)
    return 0


def _migrate(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    from projections.migrate import migrate

    applied = migrate(common.database_url)
    print("applied: " + (", ".join(applied) or "nothing (up to date)"))
    return 0


def _gateway(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    gateway = GatewaySettings(**_overrides(args, "host", "port", "require_auth",
                                           "metrics_port", "workers"))
    if gateway.workers > 1:
        from launch.gateways import run_gateways

        return run_gateways(gateway, gateway.workers)
    run_gateway(common, gateway, reuse_port=args.reuse_port)
    return 0


def _worker(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    run_worker(common, WorkerSettings(**_overrides(
        args, "engine", "model", "served_model_name", "dtype", "max_num_seqs",
        "max_model_len", "max_num_batched_tokens", "gpu_memory_utilization",
        "tensor_parallel_size", "metrics_port", "speculative_config", "enable_prefix_caching",
        "kv_cache_memory_bytes", "load_format")))
    return 0


def _projector(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    run_projector(common, ProjectorSettings(**_overrides(args, "metrics_port")))
    return 0


def _analytics(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    run_analytics(common, AnalyticsSettings(**_overrides(args, "metrics_port", "group",
                                                         "schema_name")))
    return 0


def _memory(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    run_memory(common, MemorySettings(**_overrides(args, "port", "group", "schema_name",
                                                   "model")))
    return 0


def _contract(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    from pipeline import contract
    from pipeline.settings import REPO_ROOT

    if args.check:
        stale = contract.stale(REPO_ROOT)
        for name in stale:
            print(f"{contract.CONTRACT_DIR / name} differs from the code: run "
                  "`pipeline contract`", file=sys.stderr)
        return 1 if stale else 0
    for path in contract.write(REPO_ROOT):
        print(f"wrote {path}")
    return 0


def _demo(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    from launch.demo import run_demo

    return run_demo(common, GatewaySettings(), external_db)


Command = Callable[[argparse.Namespace, CommonSettings, bool], int]
# Each command of the parser above, and what runs it.
COMMANDS: dict[str, Command] = {
    "infra": _infra,
    "migrate": _migrate,
    "topics": lambda args, common, _: run_topics_command(common, args.fix),
    "gateway": _gateway,
    "keys": lambda args, common, _: run_keys_command(common, args),
    "kek": lambda args, common, _: run_kek_command(common, args),
    "worker": _worker,
    "projector": _projector,
    "analytics": _analytics,
    "memory": _memory,
    "usage": lambda args, common, _: run_usage_command(common, args),
    "contract": _contract,
    "replay": lambda args, common, _: run_replay_command(common, args),
    "audit": lambda args, common, _: run_audit_command(common, args),
    "erase": lambda args, common, _: run_erase_command(common, args),
    "bench": lambda args, common, _: run_bench_command(common, args),
    "rollout": lambda args, common, _: run_rollout_command(common, args),
    "fuzz": lambda args, common, _: run_fuzz_command(common, args),
    "demo": _demo,
}


def _run(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    return COMMANDS[args.command](args, common, external_db)


if __name__ == "__main__":
    sys.exit(main())
