"""``pipeline``: run each component as its own process, and the local infrastructure.

    pipeline infra up|down|status    Kafka (KRaft) + PostgreSQL on 127.0.0.1, topics, migrations
    pipeline migrate                 apply database migrations
    pipeline gateway                 the OpenAI-compatible HTTP gateway
    pipeline worker                  a generation worker (vLLM)
    pipeline projector               the Postgres projection
    pipeline replay --from-beginning rebuild the store from the log into an empty schema
    pipeline audit SESSION_ID        a session's full event history, from the log
    pipeline bench projection        projector and replay rates (needs `infra up`)
    pipeline demo                    all of the above, until Ctrl-C

Settings come from the environment (``PIPELINE_*``, ``DATABASE_URL``, ``GATEWAY_*``,
``WORKER_*``, ``PROJECTOR_*``); flags override them. See README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.settings import CommonSettings, GatewaySettings, ProjectorSettings, WorkerSettings

log = logging.getLogger("pipeline")
TINY_MODEL_NAME = "tiny-random-llama"


def _setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("PIPELINE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


# -- infrastructure -----------------------------------------------------------
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


# -- services -----------------------------------------------------------------
def run_gateway(common: CommonSettings, settings: GatewaySettings) -> None:
    import uvicorn

    from gateway.app import create_app

    app = create_app(settings, common)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                access_log=False, timeout_graceful_shutdown=10)


def resolve_model(common: CommonSettings, settings: WorkerSettings) -> tuple[Path, str]:
    if settings.model:
        path = Path(settings.model)
        return path, settings.served_model_name or path.name
    from workers.tiny_model import make_tiny_model

    path = make_tiny_model(common.state_dir / "models" / TINY_MODEL_NAME)
    log.warning("serving the tiny random model at %s: its text is noise. "
                "Set WORKER_MODEL to a model directory to serve a real model.", path)
    return path, settings.served_model_name or TINY_MODEL_NAME


def make_engine(common: CommonSettings, settings: WorkerSettings) -> Any:
    if settings.engine == "sim":
        from workers.sim_engine import SimEngine

        log.warning("SIMULATED engine: no model runs; for load and fault tests only")
        return SimEngine(settings.served_model_name or "sim", ttft_ms=settings.sim_ttft_ms,
                         tokens_per_s=settings.sim_tokens_per_s,
                         max_num_seqs=settings.max_num_seqs or 256,
                         max_model_len=settings.max_model_len or 8192)
    from workers.vllm_engine import VllmEngine

    path, name = resolve_model(common, settings)
    if not settings.model and settings.max_model_len is None:
        settings = settings.model_copy(update={"max_model_len": 512})
    return VllmEngine(settings, path, name)


def run_worker(common: CommonSettings, settings: WorkerSettings) -> None:
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import serve_metrics
    from workers.worker import Worker

    registry = CollectorRegistry()

    async def main(stop: asyncio.Event) -> None:
        engine = make_engine(common, settings)
        if settings.engine == "sim":  # fault injection, simulated engine only
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, engine.crash)
        try:
            log.info("worker ready: engine %s, model %s, max_num_seqs %d", settings.engine,
                     engine.model_name, engine.max_num_seqs)
            worker = Worker(engine, common.kafka_bootstrap, registry,
                            session_timeout_ms=settings.session_timeout_ms,
                            recovery_window_s=settings.recovery_window_s,
                            coalesce_ms=settings.coalesce_ms)
            serve_metrics(registry, settings.metrics_port)
            await worker.run(stop)
        finally:
            engine.close()

    _run_until_signalled(main)


def run_projector(common: CommonSettings, settings: ProjectorSettings) -> None:
    from prometheus_client import CollectorRegistry

    from pipeline.metrics import serve_metrics
    from projections.migrate import migrate
    from projections.projector import Projector

    migrate(common.database_url)
    registry = CollectorRegistry()
    serve_metrics(registry, settings.metrics_port)
    projector = Projector(settings, common.kafka_bootstrap, common.database_url, registry)
    _run_until_signalled(projector.run)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(common: CommonSettings, gateway: GatewaySettings, external_db: bool) -> int:
    from infra.process import wait_http

    # Ctrl-C and SIGTERM both stop everything, even where SIGINT was inherited ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    infra_up(common, external_db)
    exe = [sys.executable, "-m", "pipeline"]
    # Each component in its own process group: the demo forwards Ctrl-C as SIGTERM,
    # and one that will not stop is killed with every process it started (vLLM's engine).
    procs = {name: subprocess.Popen([*exe, name], start_new_session=True)
             for name in ("projector", "worker", "gateway")}
    base = f"http://{gateway.host}:{gateway.port}"
    try:
        try:
            wait_http(f"{base}/health", list(procs.values()), timeout=120)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from None
        print(_demo_banner(base, gateway.models.split(",")[0]), flush=True)
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the demo", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        infra_down(common)


def _demo_banner(base: str, model: str) -> str:
    return f"""
The pipeline is up on {base}  (open: no API key on 127.0.0.1).
The worker serves '{model}'; with the tiny random model its text is noise.
The worker's engine may take ~30 s more to warm up; requests wait for it.

  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}'

  # the reply's X-Session-Id header names the session; its stored history:
  curl {base}/v1/sessions/SESSION_ID/messages

Ctrl-C stops everything (data stays under .state/).
"""


# -- argument parsing -----------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    infra = sub.add_parser("infra", help="local Kafka and PostgreSQL")
    infra.add_argument("action", choices=["up", "down", "status"])
    sub.add_parser("migrate", help="apply database migrations")
    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    gw.add_argument("--host")
    gw.add_argument("--port", type=int)
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
                    help="emit at most one TokenDelta per N ms per request (0: per step)")
    wk.add_argument("--metrics-port", type=int)
    pj = sub.add_parser("projector", help="run the Postgres projection")
    pj.add_argument("--metrics-port", type=int)
    rp = sub.add_parser("replay", help="rebuild the store from the log into an empty target")
    rp.add_argument("--from-beginning", action="store_true", required=True,
                    help="read both topics from their start (the only mode)")
    target = rp.add_mutually_exclusive_group()
    target.add_argument("--schema", help="rebuild into this new schema of DATABASE_URL")
    target.add_argument("--target-url", help="rebuild into this (empty) database")
    rp.add_argument("--until", type=_timestamp,
                    help="only events that occurred at or before this ISO-8601 time")
    au = sub.add_parser("audit", help="print a session's event history from the log")
    au.add_argument("session_id", type=uuid.UUID)
    au.add_argument("--json", action="store_true", help="one JSON object per line")
    au.add_argument("--deltas", action="store_true", help="list every TokenDelta")
    bench = sub.add_parser("bench", help="benchmark programs that print and save figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    bp = bench_sub.add_parser("projection", help="projector and replay events/s")
    bp.add_argument("--turns", type=int, default=10_000)
    bp.add_argument("--deltas", type=int, default=16, help="TokenDeltas per synthetic turn")
    bp.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    bw = bench_sub.add_parser("worker", help="vLLM worker tokens/s: pipeline vs AsyncLLM")
    bw.add_argument("--concurrency", default="1,8,32",
                    help="comma-separated closed-loop client counts")
    bw.add_argument("--max-tokens", type=int, default=128)
    bw.add_argument("--port", type=int, default=8011, help="the bench gateway's port")
    bw.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    sub.add_parser("demo", help="infra, projector, worker and gateway until Ctrl-C")
    return parser


def _timestamp(text: str) -> datetime:
    moment = datetime.fromisoformat(text)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def run_replay_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from projections.replay import ReplayError, run_replay

    url = args.target_url or common.database_url
    if not args.target_url and not args.schema:
        raise SystemExit("replay needs a target: --schema NAME or --target-url URL "
                         "(the live store is never overwritten)")
    try:
        stats = run_replay(common.kafka_bootstrap, url, args.schema, args.until)
    except (ReplayError, ValueError) as exc:
        print(f"replay refused: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {stats.records} records in {stats.seconds:.1f}s "
          f"({stats.rate:,.0f} events/s): {stats.applied} applied, "
          f"{stats.skipped_after_until} after --until, {stats.undecodable} undecodable")
    return 0


def run_worker_bench(common: CommonSettings, args: argparse.Namespace) -> int:
    from workers import bench

    levels = [int(c) for c in args.concurrency.split(",")]
    settings = WorkerSettings()
    settings = settings.model_copy(update={
        "max_num_seqs": settings.max_num_seqs or max(32, *levels),
        "max_model_len": settings.max_model_len or 512})
    path, name = resolve_model(common, settings)
    figures = bench.bench(settings, path, name, levels, args.max_tokens, args.port,
                          common.state_dir / "bench-logs")
    print(bench.report(figures, args.out))
    return 0


def run_audit_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from projections.audit import audit, format_text

    entries = audit(common.kafka_bootstrap, args.session_id)
    if not entries:
        print(f"no events for session {args.session_id}", file=sys.stderr)
        return 1
    if args.json:
        for entry in entries:
            print(json.dumps(entry.to_json(), ensure_ascii=False))
    else:
        print(format_text(entries, deltas=args.deltas))
    return 0


def _overrides(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    common = CommonSettings()
    external_db = "DATABASE_URL" in os.environ
    if args.command == "infra":
        if args.action == "up":
            infra_up(common, external_db)
        elif args.action == "down":
            infra_down(common)
        else:
            return infra_status(common, external_db)
    elif args.command == "migrate":
        from projections.migrate import migrate

        applied = migrate(common.database_url)
        print("applied: " + (", ".join(applied) or "nothing (up to date)"))
    elif args.command == "gateway":
        gateway = GatewaySettings(**_overrides(args, "host", "port"))
        run_gateway(common, gateway)
    elif args.command == "worker":
        worker = WorkerSettings(**_overrides(
            args, "engine", "model", "served_model_name", "dtype", "max_num_seqs",
            "max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "metrics_port",
            "speculative_config", "enable_prefix_caching", "kv_cache_memory_bytes",
            "coalesce_ms"))
        run_worker(common, worker)
    elif args.command == "projector":
        run_projector(common, ProjectorSettings(**_overrides(args, "metrics_port")))
    elif args.command == "replay":
        return run_replay_command(common, args)
    elif args.command == "audit":
        return run_audit_command(common, args)
    elif args.command == "bench" and args.bench == "projection":
        from projections.bench import run

        print(run(common.kafka_bootstrap, common.database_url, args.turns, args.deltas,
                  common.partitions, args.out))
    elif args.command == "bench" and args.bench == "worker":
        return run_worker_bench(common, args)
    elif args.command == "demo":
        return run_demo(common, GatewaySettings(), external_db)
    return 0


if __name__ == "__main__":
    sys.exit(main())
