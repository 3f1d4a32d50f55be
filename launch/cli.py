"""``pipeline``: run each component as its own process, and the local infrastructure.

    pipeline infra up|down|status    Kafka (KRaft) + PostgreSQL on 127.0.0.1, topics, migrations
                                     (up --secure: TLS and SASL/SCRAM listeners too)
    pipeline migrate                 apply database migrations
    pipeline topics                  create the pipeline's topics on an operator's cluster
    pipeline gateway                 the OpenAI-compatible HTTP gateway
    pipeline worker                  a generation worker (vLLM)
    pipeline projector               the Postgres projection
    pipeline analytics               usage and quality figures (faust-streaming)
    pipeline memory                  users' long-term memory: its store and recall API
    pipeline usage --tenant T        a tenant's usage per minute, hour or day, as a table
    pipeline contract [--check]      the events' JSON Schema and the topics' AsyncAPI document
    pipeline replay --from-beginning rebuild the store from the log into an empty schema
    pipeline audit SESSION_ID        a session's full event history, from the log
    pipeline erase --conversation ID an operator's erasure (or --user U --tenant T): the
                                     conversations' data keys destroyed, in the log too
    pipeline rollout ALIAS --to V    a share of an alias's turns to version V, judged, then
                                     promoted or rolled back; `rollout status` shows them
    pipeline keys create|list|revoke API keys (per tenant, with rate limits)
    pipeline bench [--quick] [PART]  serving, capacity, log, fairness, projection, analytics,
                                     sealing
    pipeline bench pair --b-env N=V  a change's cost per token, before / after, in pairs
    pipeline fuzz [--examples N]     fuzz a running gateway from its OpenAPI document
    pipeline demo                    all of the above, until Ctrl-C

Settings come from the environment (``PIPELINE_*``, ``DATABASE_URL``, ``GATEWAY_*``,
``WORKER_*``, ``PROJECTOR_*``, ``ANALYTICS_*``, ``MEMORY_*``); flags override them. See
docs/running.md.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.settings import GatewaySettings
from launch.services import (
    resolve_model,
    run_analytics,
    run_gateway,
    run_memory,
    run_projector,
    run_worker,
)
from memory.settings import MemorySettings
from pipeline.kafka.config import AccessRefused, ClientConfigError
from pipeline.logs import log_format, setup_logging
from pipeline.retry import RepeatFilter
from pipeline.settings import CommonSettings
from projections.migrate import MigrationError
from projections.settings import AnalyticsSettings, ProjectorSettings
from schemas.rollout import HealthPolicy
from workers.settings import WorkerSettings

log = logging.getLogger("pipeline")


def _setup_logging() -> None:
    setup_logging(os.environ.get("PIPELINE_LOG_LEVEL", "INFO"), log_format())
    # The connection pool logs each failed attempt to reach a database that is away:
    # once per 30 s per kind of failure is enough.
    logging.getLogger("psycopg.pool").addFilter(RepeatFilter(every_s=30.0))
    # httpx logs every request at INFO with its whole URL: a gateway's call to the memory
    # service names its end user in the query (the marker test found it in the log).
    logging.getLogger("httpx").setLevel(logging.WARNING)


# -- argument parsing -----------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    infra = sub.add_parser("infra", help="local Kafka and PostgreSQL")
    infra.add_argument("action", choices=["up", "down", "status"])
    infra.add_argument("--brokers", type=_positive,
                       help="up: Kafka nodes in the local cluster (default PIPELINE_BROKERS, 1)")
    infra.add_argument("--secure", action="store_true",
                       help="up: also listen with SASL_SSL (SCRAM) on port+100 and mutual "
                            "TLS on port+101, and write the matching client files")
    sub.add_parser("migrate", help="apply database migrations")
    sub.add_parser("topics", help="create the pipeline's topics on the configured cluster "
                                  "(PIPELINE_KAFKA_BOOTSTRAP), if missing")
    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
    gw.add_argument("--require-auth", action="store_true", default=None,
                    help="refuse requests without an API key even before any key exists")
    gw.add_argument("--metrics-port", type=int,
                    help="serve /metrics on this port (GATEWAY_METRICS_HOST) instead; "
                         "with --workers, gateway i on this port + i")
    gw.add_argument("--workers", type=_positive,
                    help="gateway processes sharing the port (default GATEWAY_WORKERS, 1)")
    gw.add_argument("--reuse-port", action="store_true",
                    help="listen with SO_REUSEPORT, sharing the port with other gateways")
    keys = sub.add_parser("keys", help="API keys: create, list, revoke")
    keys_sub = keys.add_subparsers(dest="keys", required=True)
    kc = keys_sub.add_parser("create", help="create a key and print it (once)")
    kc.add_argument("--tenant", required=True, help="the tenant the key acts for")
    kc.add_argument("--name", help="a label, e.g. who holds the key")
    kc.add_argument("--rpm", type=_positive, help="requests per minute (default: unlimited)")
    kc.add_argument("--tpm", type=_positive, help="tokens per minute (default: unlimited)")
    kl = keys_sub.add_parser("list", help="list keys (never their secrets)")
    kl.add_argument("--json", action="store_true", help="one JSON object per line")
    kr = keys_sub.add_parser("revoke", help="revoke a key: refused from then on")
    kr.add_argument("key_id", help="the id shown by create and list (sk-<id>.…)")
    kek = sub.add_parser("kek", help="the key-encryption key of the data keys")
    kek_sub = kek.add_subparsers(dest="kek", required=True)
    kek_sub.add_parser("rotate", help="wrap every data key anew with PIPELINE_KEK, replacing "
                       "PIPELINE_KEK_PREVIOUS, while the service runs")
    wk = sub.add_parser("worker", help="run a generation worker")
    wk.add_argument("--engine", choices=["vllm", "sim"],
                    help="vllm (default), or sim: a SIMULATED engine for load/fault tests")
    wk.add_argument("--model", help="model directory (default: the tiny random model)")
    wk.add_argument("--served-model-name")
    wk.add_argument("--dtype")
    wk.add_argument("--max-num-seqs", type=int)
    wk.add_argument("--max-model-len", type=int)
    wk.add_argument("--gpu-memory-utilization", type=float)
    wk.add_argument("--tensor-parallel-size", type=int)
    wk.add_argument("--speculative-config", type=json.loads,
                    help='vLLM speculative decoding, as JSON: \'{"method": "ngram", ...}\'')
    wk.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None)
    wk.add_argument("--kv-cache-memory-bytes", type=int)
    wk.add_argument("--coalesce-ms", type=float,
                    help="one TokenDelta per request per N ms window (0: per step)")
    wk.add_argument("--metrics-port", type=int)
    pj = sub.add_parser("projector", help="run the Postgres projection")
    pj.add_argument("--metrics-port", type=int)
    an = sub.add_parser("analytics", help="run the analytics consumer (faust-streaming)")
    an.add_argument("--metrics-port", type=int)
    an.add_argument("--group", help="its consumer group (default analytics)")
    an.add_argument("--schema", dest="schema_name",
                    help="write the tables into this schema of DATABASE_URL (a rebuild)")
    me = sub.add_parser("memory", help="run the memory service (store and recall API)")
    me.add_argument("--port", type=int)
    me.add_argument("--group", help="its consumer group (default memory)")
    me.add_argument("--schema", dest="schema_name",
                    help="keep the memories in this schema of DATABASE_URL (a rebuild)")
    me.add_argument("--model", help="the embedding model (default: the tiny random one)")
    us = sub.add_parser("usage", help="a tenant's usage, as GET /v1/usage gives it")
    us.add_argument("--tenant", default="default")
    us.add_argument("--start", type=_timestamp, help="ISO-8601 (default: a bucket-width "
                    "limit back from now)")
    us.add_argument("--end", type=_timestamp, help="ISO-8601 (default: now)")
    us.add_argument("--bucket-width", choices=["1m", "1h", "1d"], default="1h")
    us.add_argument("--group-by", choices=["model"], action="append", default=[])
    us.add_argument("--schema", help="read the tables from this schema of DATABASE_URL")
    us.add_argument("--json", action="store_true", help="the /v1/usage document")
    ct = sub.add_parser("contract", help="write docs/contract/ (JSON Schema, AsyncAPI)")
    ct.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if the files differ from the code")
    rp = sub.add_parser("replay", help="rebuild the store from the log into an empty target")
    rp.add_argument("--from-beginning", action="store_true", required=True,
                    help="read both topics from their start (the only mode)")
    target = rp.add_mutually_exclusive_group()
    target.add_argument("--schema", help="rebuild into this new schema of DATABASE_URL")
    target.add_argument("--target-url", help="rebuild into this (empty) database")
    rp.add_argument("--until", type=_timestamp,
                    help="only events that occurred at or before this ISO-8601 time")
    er = sub.add_parser("erase", help="erase a conversation, or a user's conversations, "
                        "from the store and the log (their data keys are destroyed)")
    which = er.add_mutually_exclusive_group(required=True)
    which.add_argument("--conversation", type=uuid.UUID, metavar="ID",
                       help="the conversation (session) id")
    which.add_argument("--user", metavar="USER",
                       help="every conversation whose key or memory names this user")
    er.add_argument("--tenant", help="the user's tenant (with --user; default: default); "
                    "with --conversation, refused unless the conversation's own")
    er.add_argument("--projector-group", default="projector",
                    help="the projector's consumer group, whose store it waits for")
    au = sub.add_parser("audit", help="print a session's event history from the log")
    au.add_argument("session_id", type=uuid.UUID)
    au.add_argument("--json", action="store_true", help="one JSON object per line")
    au.add_argument("--deltas", action="store_true", help="list every TokenDelta")
    au.add_argument("--since", type=_timestamp,
                    help="read from this ISO-8601 time (default: the session's creation, "
                    "as the store knows it)")
    au.add_argument("--from-beginning", action="store_true",
                    help="read the session's partitions from their start")
    ro = sub.add_parser("rollout", help="send a share of a model alias's new turns to "
                        "another version; promote or roll back on its health")
    ro.add_argument("alias", help="the model name clients ask for (`pipeline rollout "
                    "status [ALIAS]` shows where rollouts stand)")
    ro.add_argument("status_alias", nargs="?", metavar="ALIAS", help=argparse.SUPPRESS)
    ro.add_argument("--to", metavar="VERSION",
                    help="the version (a worker group's --served-model-name) to roll out")
    ro.add_argument("--share", type=_share, default=0.1,
                    help="share of new conversations sent to it meanwhile (default 0.1)")
    ro.add_argument("--turns", type=_positive, default=HealthPolicy.turns,
                    help="judge it over its first N ended turns (default %(default)s)")
    ro.add_argument("--max-failure-increase", type=float,
                    default=HealthPolicy.max_failure_increase,
                    help="failure rate allowed above the old version's (default %(default)s)")
    ro.add_argument("--max-ttft-ratio", type=float, default=HealthPolicy.max_ttft_ratio,
                    help="TTFT p99 allowed, times the old version's (default %(default)s)")
    ro.add_argument("--ttft-slack-ms", type=float, default=HealthPolicy.ttft_slack_ms,
                    help="or this much above it, whichever is more (default %(default)s)")
    ro.add_argument("--timeout", type=float, default=HealthPolicy.timeout_s,
                    help="seconds to gather the turns before rolling back (default "
                         "%(default)s)")
    ro.add_argument("--abort", action="store_true", help="end a running rollout: roll back")
    ro.add_argument("--json", action="store_true", help="status: one JSON record per alias")
    bench = sub.add_parser("bench", help="benchmark programs that print and save figures")
    bench.add_argument("part", nargs="*", metavar="PART",
                       help="serving (the engine, vllm serve, the pipeline), capacity "
                            "(simulated engine), log (bytes), fairness (between tenants), "
                            "projection, analytics, sealing, memory; default: all of "
                            "those; scale (a year of state, its own stack), when named; "
                            "or pair, alone (below)")
    bench.add_argument("--conversations", type=_positive, default=1_000_000,
                       help="scale: the conversations the history holds (default "
                            "%(default)s; 10000000 for ten million)")
    bench.add_argument("--before", type=_checkout, metavar="PATH",
                       help="log: a checkout of earlier code, measured beside this one in "
                            "the same run")
    bench.add_argument("--quick", action="store_true",
                       help="small loads, a few minutes; figures under .state/bench")
    bench.add_argument("--out", type=Path, help="where to write (default docs/benchmarks)")
    ab = bench.add_argument_group(
        "pair", "pipeline bench pair: one change's effect as before / after ratios measured "
        "in one run, side A (before) then B (after), alternating; figures under .state/bench")
    for side in ("a", "b"):
        ab.add_argument(f"--{side}-env", action="append", default=[], type=_setting,
                        metavar="NAME=VALUE", help=f"a setting for side {side.upper()}'s "
                        "stack (repeatable)")
        ab.add_argument(f"--{side}-tree", type=_checkout, metavar="PATH",
                        help=f"a checkout whose code side {side.upper()} runs (default: "
                             "this one)")
        ab.add_argument(f"--{side}-python", type=_interpreter, metavar="PATH",
                        help=f"the Python side {side.upper()}'s processes run, a virtual "
                             "environment's bin/python with this project installed "
                             "(default: this one's)")
    ab.add_argument("--rate", type=_rate, default=20.0,
                    help="tokens/s per stream, 256 streams (default %(default)s)")
    ab.add_argument("--pairs", type=_positive, default=2, help="default %(default)s")
    ab.add_argument("--rounds", type=_positive, default=3,
                    help="rounds of 256 streams per run (default %(default)s)")
    ab.add_argument("--label", default="pair", type=_label,
                    help="names the report: pair-LABEL.md (letters, digits, . _ -)")
    fz = sub.add_parser("fuzz", help="fuzz a running gateway from its OpenAPI document "
                                     "(schemathesis, every route): fails on any 5xx")
    fz.add_argument("--url", help="the gateway (default: GATEWAY_HOST and GATEWAY_PORT)")
    fz.add_argument("--examples", type=int, default=1000,
                    help="examples per route (default %(default)s; make test runs 25)")
    fz.add_argument("--seed", type=int, help="hypothesis's seed (default: random)")
    fz.add_argument("--key", help="an API key to send, when the gateway requires one")
    sub.add_parser("demo", help="infra, projector, worker and gateway until Ctrl-C")
    return parser


def run_fuzz_command(args: argparse.Namespace) -> int:
    """schemathesis against the gateway's own document: no request may get a server
    error (run it against a healthy stack: a 503 while a dependency is away counts)."""
    settings = GatewaySettings()
    url = (args.url or f"http://{settings.host}:{settings.port}").rstrip("/")
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        raise SystemExit("pipeline fuzz: schemathesis is not installed (pip install "
                         "'.[dev]')")
    command = [str(st), "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", str(args.examples), "--workers", "1"]
    if args.seed is not None:
        command += ["--seed", str(args.seed)]
    if args.key:
        command += ["--header", f"Authorization: Bearer {args.key}"]
    print(" ".join(c if "Bearer" not in c else "Authorization: Bearer ..." for c in command),
          flush=True)
    return subprocess.run(command, check=False).returncode


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _checkout(text: str) -> Path:
    path = Path(text).resolve()
    if not (path / "launch" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a checkout of this project "
                                         "(no launch/__main__.py)")
    return path


def _interpreter(text: str) -> Path:
    path = Path(text).absolute()  # a venv's python is a link: keep the venv's own path
    if not path.is_file() or not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} is not an executable file")
    try:
        done = subprocess.run([str(path), "-c", "import launch, confluent_kafka; print('ok')"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise argparse.ArgumentTypeError(f"{text} cannot run this project ({exc})") from None
    if done.stdout.strip() != "ok":
        said = (done.stderr.strip().splitlines() or ["it is not a Python"])[-1]
        raise argparse.ArgumentTypeError(f"{text} cannot run this project ({said})")
    return path


def _label(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text):
        raise argparse.ArgumentTypeError("letters, digits, '.', '_' and '-', at most 64, "
                                         "starting with a letter or digit")
    return text


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError("tokens/s per stream: above 0 and at most 1000")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be above 0 and at most 1")
    return value


def run_rollout_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.rollout import Controller, RolloutRefused
    from pipeline.rollout import RolloutBook
    from schemas.rollout import describe

    if args.alias == "status":
        book = RolloutBook(common.kafka_bootstrap)
        try:
            records = book.read_to_end()
        finally:
            book.close()
        shown = [r for a, r in sorted(records.items())
                 if args.status_alias in (None, a)]
        if not shown:
            print("no rollout yet" + (f" of {args.status_alias}" if args.status_alias
                                      else ""), file=sys.stderr)
            return 1
        for record in shown:
            print(record.model_dump_json() if args.json else describe(record))
        return 0
    if args.status_alias is not None:
        print(f"pipeline rollout: unexpected argument {args.status_alias!r}", file=sys.stderr)
        return 2
    for name in (args.alias, args.to or "x"):
        if not 0 < len(name) <= 200 or not name.isprintable():
            print(f"pipeline rollout: a model name is 1 to 200 printable characters: "
                  f"{name[:40]!r}", file=sys.stderr)
            return 2
    controller = Controller(common.kafka_bootstrap)
    policy = HealthPolicy(args.turns, args.max_failure_increase, args.max_ttft_ratio,
                          args.ttft_slack_ms, args.timeout)
    try:
        if args.abort:
            controller.abort(args.alias)
            return 0
        if not args.to:
            print("pipeline rollout: name the version: --to VERSION", file=sys.stderr)
            return 2
        record = controller.start(args.alias, args.to, args.share, policy)
    except RolloutRefused as exc:
        print(f"pipeline rollout: {exc}", file=sys.stderr)
        return 2
    return 0 if controller.watch(record, policy).status == "promoted" else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run_topics_command(common: CommonSettings) -> int:
    """The topics an operator's cluster needs, made with the topic settings
    (``PIPELINE_PARTITIONS``, ``PIPELINE_REPLICATION_FACTOR``, ...); existing ones are
    kept (their record limit raised to the pipeline's)."""
    from pipeline.kafka import broker_count, ensure_topics
    from pipeline.topics import topic_specs

    specs = topic_specs(common.topic_policy(), broker_count(common.kafka_bootstrap))
    created = ensure_topics(common.kafka_bootstrap, specs)
    for spec in specs:
        print(f"{spec.name:<20} " + (
            f"created ({spec.partitions} partitions, replication {spec.replication}, "
            f"{spec.config.get('min.insync.replicas')} in sync)" if spec.name in created
            else "exists (kept as it is)"))
    return 0


def run_keys_command(common: CommonSettings, args: argparse.Namespace) -> int:
    import psycopg

    from gateway import keys
    from projections.migrate import migrate

    migrate(common.database_url)
    with psycopg.connect(common.database_url, autocommit=True) as conn:
        if args.keys == "create":
            secret, key = keys.create(conn, args.tenant, args.name, args.rpm, args.tpm)
            print(secret)
            print(f"key {key.id} for tenant '{key.tenant}' (rpm {key.rpm or 'unlimited'}, "
                  f"tpm {key.tpm or 'unlimited'}). It is shown only now: store it safely.",
                  file=sys.stderr)
        elif args.keys == "list":
            for key in keys.listed(conn):
                if args.json:
                    print(json.dumps(key.to_json()))
                else:
                    state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at \
                        else "active"
                    print(f"{key.id}  {key.tenant:<20} {key.name or '-':<20} "
                          f"rpm {key.rpm or '-':<8} tpm {key.tpm or '-':<10} {state}")
        else:
            return _revoke(common, conn, args.key_id)
    return 0


def _revoke(common: CommonSettings, conn: Any, key_id: str) -> int:
    """Revoke a key, and stop its turns still running, background ones included (again
    for a key revoked before), once now and once after the gateways' 2 s cache of it
    (turns accepted meanwhile, or that the store had not shown yet)."""
    from gateway import keys

    if keys.revoke(conn, key_id):
        print(f"revoked {key_id}; gateways refuse it within 2 s", flush=True)
    elif not any(k.id == key_id for k in keys.listed(conn)):
        print(f"no key {key_id}", file=sys.stderr)
        return 1
    else:
        print(f"{key_id} was revoked already", flush=True)
    for sweep in (0, 1):
        if sweep:
            time.sleep(3.0)
        stopped = keys.stop_turns(conn, common.kafka_bootstrap, key_id)
        if stopped:
            print(f"stopped {stopped} of its turns", flush=True)
    return 0


def _timestamp(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def run_replay_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from pipeline.keystore import open_keyring
    from projections.replay import ReplayError, run_replay

    url = args.target_url or common.database_url
    if not args.target_url and not args.schema:
        raise SystemExit("replay needs a target: --schema NAME or --target-url URL "
                         "(the live store is never overwritten)")
    try:
        with open_keyring(common, "replay", read_ahead=True):
            stats = run_replay(common.kafka_bootstrap, url, args.schema, args.until)
    except (ReplayError, ValueError) as exc:
        print(f"replay refused: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {stats.records} records in {stats.seconds:.1f}s "
          f"({stats.rate:,.0f} events/s): {stats.applied} applied, "
          f"{stats.skipped_after_until} after --until, {stats.undecodable} undecodable")
    return 0


def run_bench_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from bench import run as bench
    from infra.process import StartupFailed
    from launch.local import infra_up

    unknown = set(args.part) - {*bench.PARTS, *bench.NAMED_ONLY, "pair"}
    if unknown:
        raise SystemExit(f"unknown bench part(s): {', '.join(sorted(unknown))}; choose "
                         f"from {', '.join((*bench.PARTS, *bench.NAMED_ONLY))}, or pair")
    pairing = (args.a_env or args.b_env or args.a_tree or args.b_tree or args.a_python
               or args.b_python)
    if "pair" in args.part:
        if len(args.part) > 1:
            raise SystemExit("pipeline bench pair runs alone")
        if not pairing:
            raise SystemExit("pipeline bench pair: the sides are the same; give side B (or "
                             "A) a setting (--b-env NAME=VALUE), a checkout (--b-tree PATH) "
                             "or an interpreter (--b-python PATH)")
    elif pairing:
        raise SystemExit("--a-env, --b-env, --a-tree, --b-tree, --a-python and --b-python are "
                         "for pipeline bench pair")
    infra_up(common, "DATABASE_URL" in os.environ)  # the stack the bench runs on
    try:
        if "pair" in args.part:
            from bench.pair import Side

            sides = (Side("A", dict(args.a_env), args.a_tree, args.a_python),
                     Side("B", dict(args.b_env), args.b_tree, args.b_python))
            report = bench.pair(common, args.out or common.state_dir / "bench", args.label,
                                sides, rate=args.rate, pairs=args.pairs, rounds=args.rounds)
            print(f"\n{report}")
        else:
            out = args.out or (common.state_dir / "bench" if args.quick
                               else Path("docs/benchmarks"))
            bench.run(common, list(args.part) or list(bench.PARTS), args.quick, out,
                      resolve_model, args.before, args.conversations)
    except StartupFailed as exc:
        raise SystemExit(f"pipeline bench: {exc}") from None
    return 0


def run_usage_command(common: CommonSettings, args: argparse.Namespace) -> int:
    import psycopg

    from gateway.usage_query import UsageError, UsageQuery, format_table, usage
    from projections.migrate import in_schema

    end = args.end or datetime.now(UTC)
    try:
        query = UsageQuery.build(args.tenant, args.start and int(args.start.timestamp()),
                                 int(end.timestamp()), args.bucket_width, args.group_by)
    except UsageError as exc:
        print(f"pipeline usage: {exc}", file=sys.stderr)
        return 2
    with psycopg.connect(in_schema(common.database_url, args.schema)) as conn:
        page = usage(conn, query)
    print(json.dumps(page, indent=2) if args.json else format_table(page, query))
    return 0


def run_kek_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.rotate import RotationError, rotate_command

    try:
        return rotate_command(common, args)
    except RotationError as exc:
        print(f"pipeline kek rotate: {exc}", file=sys.stderr)
        return 1


def run_erase_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.erase import erase_command

    return erase_command(common, args)


def run_audit_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from pipeline.keystore import open_keyring
    from projections.audit import audit, format_text

    since = args.since or (None if args.from_beginning else _created(common, args.session_id))
    with open_keyring(common, "audit"):
        if since is None and not args.from_beginning:
            print("the store does not know when this session began: reading its "
                  "partitions from their start (--since bounds the read)", file=sys.stderr)
        entries, live = audit(common.kafka_bootstrap, args.session_id,
                              None if since is None else int(since.timestamp() * 1000))
    if not entries:
        print(f"no events for session {args.session_id}", file=sys.stderr)
        return 1
    if args.json:
        for line in [e.to_json() for e in entries] + [e.to_json() for e in live]:
            print(json.dumps(line, ensure_ascii=False))
    else:
        print(format_text(entries, live, deltas=args.deltas))
    return 0


def _created(common: CommonSettings, conversation: uuid.UUID) -> datetime | None:
    """When the store says the conversation began (its first event, or its first key);
    None if it does not know, or does not answer."""
    import psycopg

    try:
        with psycopg.connect(common.database_url, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT least((SELECT created_at FROM conversations WHERE id = %(c)s),"
                " (SELECT min(created_at) FROM data_keys WHERE conversation_id = %(c)s))",
                {"c": conversation}).fetchone()
    except psycopg.Error:
        return None
    return row[0] if row else None


def _overrides(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    common = CommonSettings()
    external_db = "DATABASE_URL" in os.environ
    if args.command in ONE_SHOT:
        # A one-shot command ends with its answer or one line saying which service did
        # not answer; the Kafka client's log of each retry until then says no more.
        for name in ("librdkafka", "pipeline.kafka"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
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
    except (AccessRefused, ClientConfigError, MigrationError) as exc:
        print(f"pipeline {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        down = service_down(exc, common, external_db)
        if down is None:
            raise
        print(f"pipeline {args.command}: {down}", file=sys.stderr)
        return 3


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
        "max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "metrics_port",
        "speculative_config", "enable_prefix_caching", "kv_cache_memory_bytes",
        "coalesce_ms")))
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
    "topics": lambda args, common, _: run_topics_command(common),
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
    "fuzz": lambda args, common, _: run_fuzz_command(args),
    "demo": _demo,
}


def _run(args: argparse.Namespace, common: CommonSettings, external_db: bool) -> int:
    return COMMANDS[args.command](args, common, external_db)


if __name__ == "__main__":
    sys.exit(main())
