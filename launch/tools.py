"""The tools run against the pipeline: ``pipeline bench`` and ``pipeline fuzz``."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from gateway.settings import GatewaySettings
from launch.services import resolve_model
from pipeline.settings import CommonSettings


def run_fuzz_command(common: CommonSettings, args: argparse.Namespace) -> int:
    """schemathesis against the gateway's own document: no request may get a server
    error (run it against a healthy stack: a 503 while a dependency is away counts). It
    runs in ``<state dir>/fuzz``, where it keeps its example database, so that the
    directory it is called from is left as it was."""
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
    workdir = common.state_dir / "fuzz"
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, check=False, cwd=workdir).returncode


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
    elif args.part == ["worker"]:
        if args.a_env or args.b_env or args.a_python or args.b_python:
            raise SystemExit("pipeline bench worker compares checkouts only (--a-tree, "
                             "--b-tree): its settings and interpreter are this one's")
    elif pairing or args.streams is not None or args.rate is not None:
        raise SystemExit("--a-env, --b-env, --a-tree, --b-tree, --a-python, --b-python, "
                         "--streams and --rate are for pipeline bench pair (and worker, "
                         "alone)")
    infra_up(common, "DATABASE_URL" in os.environ)  # the stack the bench runs on
    try:
        if "pair" in args.part:
            from bench.pair import Side

            sides = (Side("A", dict(args.a_env), args.a_tree, args.a_python),
                     Side("B", dict(args.b_env), args.b_tree, args.b_python))
            report = bench.pair(common, args.out or common.state_dir / "bench", args.label,
                                sides, rate=args.rate or 20.0, pairs=args.pairs,
                                rounds=args.rounds,
                                streams=args.streams or 256)
            print(f"\n{report}")
        else:
            out = args.out or (common.state_dir / "bench" if args.quick
                               else Path("docs/benchmarks"))
            engine = {name: getattr(args, name) for name in (
                "model", "load_format", "dtype", "kv_cache_memory_bytes",
                "gpu_memory_utilization", "max_num_seqs", "max_model_len")
                if getattr(args, name) is not None}
            shape = bench.ServingShape(engine, args.clients, args.max_tokens,
                                       args.prompt_tokens)
            trees = ({"A": args.a_tree, "B": args.b_tree}
                     if args.a_tree or args.b_tree else None)
            load = bench.WorkerLoad(args.streams or 256, args.rate or 100.0, trees, args.pairs)
            bench.run(common, list(args.part) or list(bench.PARTS), args.quick, out,
                      resolve_model, args.before, args.conversations, shape, load,
                      args.erasures)
    except StartupFailed as exc:
        raise SystemExit(f"pipeline bench: {exc}") from None
    return 0
