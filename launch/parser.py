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
import json
import os
import re
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path

from schemas.rollout import HealthPolicy


def parser() -> argparse.ArgumentParser:
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
    migrate = sub.add_parser("migrate", help="apply database migrations")
    topics = sub.add_parser("topics", help="create the pipeline's topics on the configured "
                                           "cluster (PIPELINE_KAFKA_BOOTSTRAP), if missing, "
                                           "and check the settings of those that exist")
    topics.add_argument("--fix", action="store_true",
                        help="set what differs from the pipeline's settings on existing "
                             "topics, but for what would make a topic keep less (that is "
                             "shown, for the operator to do)")
    for setup in (migrate, topics):
        setup.add_argument(
            "--wait", type=_seconds, default=0.0, metavar="SECONDS",
            help="while the database (migrate) or Kafka (topics) does not answer yet, try "
                 "again for up to this long (a deployment's setup step, started beside "
                 "them); default 0: fail at once")
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
    wk.add_argument("--max-num-batched-tokens", type=int)
    wk.add_argument("--gpu-memory-utilization", type=float)
    wk.add_argument("--tensor-parallel-size", type=int)
    wk.add_argument("--speculative-config", type=json.loads,
                    help='vLLM speculative decoding, as JSON: \'{"method": "ngram", ...}\'')
    wk.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None)
    wk.add_argument("--kv-cache-memory-bytes", type=int)
    wk.add_argument("--load-format", choices=["auto", "dummy", "safetensors", "pt"],
                    help="dummy: random weights from the model's config (no weight files)")
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
                            "projection, analytics, sealing, hotpath (the worker's per-"
                            "token path), frontend (vLLM's front end: detokenising "
                            "and not, in the process and apart), "
                            "worker (one worker alone at a GPU's rate), memory; "
                            "default: all of "
                            "those; scale (a year of state, its own stack), when named; "
                            "or pair, alone (below)")
    bench.add_argument("--conversations", type=_positive, default=1_000_000,
                       help="scale: the conversations the history holds (default "
                            "%(default)s; 10000000 for ten million)")
    bench.add_argument("--erasures", type=_non_negative, default=0,
                       help="scale: erasures written with the history, which every "
                            "process reads at its start (default %(default)s)")
    bench.add_argument("--before", type=_checkout, metavar="PATH",
                       help="log: a checkout of earlier code, measured beside this one in "
                            "the same run")
    bench.add_argument("--quick", action="store_true",
                       help="small loads, a few minutes; figures under .state/bench")
    bench.add_argument("--out", type=Path, help="where to write (default docs/benchmarks)")
    sv = bench.add_argument_group(
        "serving", "pipeline bench serving: the model and the load, on a GPU host or this one "
        "(unset: the WORKER_* settings, and the tiny model); nothing is fetched")
    sv.add_argument("--model", help="a model directory; with --load-format dummy its config "
                    "and tokenizer are enough (no weight files)")
    sv.add_argument("--load-format", choices=["auto", "dummy", "safetensors", "pt"],
                    help="dummy: random weights in the model's shape")
    sv.add_argument("--dtype", help="e.g. bfloat16 on a GPU (default WORKER_DTYPE, float32)")
    sv.add_argument("--kv-cache-memory-bytes", type=_positive, metavar="BYTES",
                    help="the KV cache's size, on every engine of the run")
    sv.add_argument("--gpu-memory-utilization", type=_share, metavar="FRACTION",
                    help="instead of --kv-cache-memory-bytes: a share of GPU memory")
    sv.add_argument("--max-num-seqs", type=_positive, help="default: max(32, clients)")
    sv.add_argument("--max-model-len", type=_positive)
    sv.add_argument("--prompt-tokens", type=_positive, metavar="N",
                    help="each request's message: about N tokens (default: one sentence)")
    sv.add_argument("--max-tokens", type=_positive, metavar="N",
                    help="tokens generated per request, all of them (default 128; quick 64)")
    sv.add_argument("--clients", type=_levels, metavar="N,N,...",
                    help="closed-loop clients, one level after another (default 1,8,32; "
                         "on a GPU: 1,32,256); frontend runs the largest (default 32)")
    ab = bench.add_argument_group(
        "pair", "pipeline bench pair: one change's effect as before / after ratios measured "
        "in one run, side A (before) then B (after), alternating; figures under .state/bench. "
        "pipeline bench worker takes --a-tree, --b-tree, --pairs, --streams and --rate too")
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
    ab.add_argument("--rate", type=_rate,
                    help="tokens/s per stream (default 20; worker: 100): the SIMULATED "
                         "engine's steps per second")
    ab.add_argument("--streams", type=_positive,
                    help="streams at once (default 256); fewer at a higher --rate "
                         "keep the tokens per second and step as a GPU does (64 x 80: 12.5 "
                         "ms steps)")
    ab.add_argument("--pairs", type=_positive, default=2, help="default %(default)s")
    ab.add_argument("--rounds", type=_positive, default=3,
                    help="rounds of --streams streams per run (default %(default)s)")
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


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or any(not 1 <= n <= 4096 for n in levels):
        raise argparse.ArgumentTypeError("client counts from 1 to 4096, comma-separated "
                                         "(1,32,256)")
    return levels


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 86_400:  # NaN too
        raise argparse.ArgumentTypeError("must be between 0 and 86400 seconds")
    return value


def _timestamp(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
