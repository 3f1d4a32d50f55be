"""``pipeline bench serving``: one model and one load, three ways, in one run.

1. **engine**: vLLM's ``AsyncLLM`` in this process (the worker's ``VllmEngine``: the
   chat template and the engine, no HTTP, no Kafka): the ceiling.
2. **vllm-serve**: vLLM's own OpenAI server from the same install, over HTTP/SSE.
3. **pipeline**: gateway, Kafka, worker and projector as processes, over HTTP/SSE.

Each is a closed loop at each concurrency level, with the same engine arguments, the
same prompt and ``max_tokens`` generated in full (``ignore_eos``). They run one after
another, so they never share the CPU; the broker and PostgreSQL run throughout.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from infra.process import free_port, wait_http
from pipeline.loadgen import (
    Request,
    Summary,
    chat_body,
    closed_loop,
    http_client,
    stream_once,
)
from pipeline.settings import WorkerSettings
from schemas import ChatMessage, SamplingParams
from workers.engine import EngineRequest

PROMPT = "Write a long story about a log that remembers everything."
MODES = ("engine", "vllm-serve", "pipeline")


def rounds(concurrency: int, quick: bool) -> int:
    """Requests per client: enough for steady figures, at least 16 requests a level."""
    return max(2 if quick else 4, (16 if quick else 32) // concurrency)


async def run_engine(settings: WorkerSettings, model: Path, name: str, levels: list[int],
                     max_tokens: int, quick: bool) -> list[Summary]:
    from workers.vllm_engine import VllmEngine

    engine = VllmEngine(settings, model, name)
    messages = (ChatMessage(role="user", content=PROMPT),)

    async def one(seed: int) -> Request:
        request = Request(time.perf_counter())
        sampling = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
        async for out in engine.generate(EngineRequest(uuid.uuid4().hex, messages, sampling)):
            if out.token_ids and request.first is None:
                request.first = time.perf_counter()
            request.tokens += len(out.token_ids)
        request.ended = time.perf_counter()
        return request

    try:
        await closed_loop(one, 2, 2)  # warm-up
        return [await closed_loop(one, c, rounds(c, quick)) for c in levels]
    finally:
        engine.close()


async def run_http(url: str, name: str, levels: list[int], max_tokens: int,
                   quick: bool) -> list[Summary]:
    async with http_client(max(levels) + 8) as client:
        async def one(seed: int) -> Request:
            return await stream_once(client, url, chat_body(name, PROMPT, max_tokens, seed))

        await closed_loop(one, 2, 2)  # warm-up
        return [await closed_loop(one, c, rounds(c, quick)) for c in levels]


def _engine_flags(settings: WorkerSettings) -> list[str]:
    flags = ["--max-num-seqs", str(settings.max_num_seqs), "--max-model-len",
             str(settings.max_model_len), "--dtype", settings.dtype]
    if settings.kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    return flags


def _start(cmds: dict[str, list[str]], log_dir: Path,
           env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for label, cmd in cmds.items():
        with open(log_dir / f"bench-{label}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_vllm_serve(settings: WorkerSettings, model: Path, name: str, levels: list[int],
                   max_tokens: int, quick: bool, log_dir: Path) -> list[Summary]:
    port = free_port()
    procs = _start({"vllm-serve": [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        *_engine_flags(settings)]}, log_dir)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", procs, timeout=300)
        return asyncio.run(run_http(f"http://127.0.0.1:{port}", name, levels, max_tokens,
                                    quick))
    finally:
        _stop(procs)


def run_pipeline(settings: WorkerSettings, name: str, levels: list[int], max_tokens: int,
                 quick: bool, log_dir: Path) -> list[Summary]:
    port = free_port()
    exe = [sys.executable, "-m", "pipeline"]
    procs = _start({"projector": [*exe, "projector"],
                    "worker": [*exe, "worker", *_engine_flags(settings)],
                    "gateway": [*exe, "gateway", "--port", str(port)]}, log_dir)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", procs, timeout=120)
        return asyncio.run(run_http(f"http://127.0.0.1:{port}", name, levels, max_tokens,
                                    quick))
    finally:
        _stop(procs)


def bench(settings: WorkerSettings, model: Path, name: str, levels: list[int],
          max_tokens: int, quick: bool, log_dir: Path) -> dict[str, Any]:
    results = {
        "engine": asyncio.run(run_engine(settings, model, name, levels, max_tokens, quick)),
        "vllm-serve": run_vllm_serve(settings, model, name, levels, max_tokens, quick, log_dir),
        "pipeline": run_pipeline(settings, name, levels, max_tokens, quick, log_dir),
    }
    return {"model": name, "max_tokens": max_tokens, "max_num_seqs": settings.max_num_seqs,
            "max_model_len": settings.max_model_len,
            "modes": {m: [s.to_json() for s in summaries] for m, summaries in results.items()}}


def tables(figures: dict[str, Any]) -> str:
    """The serving figures as markdown: one table per concurrency level, then ratios."""
    modes = figures["modes"]
    out = []
    for i, level in enumerate(modes["engine"]):
        c = level["concurrency"]
        out += [f"**Concurrency {c}** ({level['requests']} requests of "
                f"{figures['max_tokens']} tokens each)", "",
                "| | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | end-to-end p50 / p99 (ms)"
                " | output tok/s | req/s | failures | client CPU |",
                "|---|---|---|---|---|---|---|---|"]
        for mode in MODES:
            s = modes[mode][i]
            t, itl, e2e = s["ttft_ms"], s["itl_ms"], s["latency_ms"]
            out.append(f"| {mode} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | "
                       f"{itl['p50']:.2f} / {itl['p99']:.2f} | {e2e['p50']:.0f} / "
                       f"{e2e['p99']:.0f} | {s['tokens_per_s']:,.0f} | "
                       f"{s['requests_per_s']:.1f} | {s['failures']} | "
                       f"{s['client_cpu']:.0%} |")
        out.append("")
    out += ["| concurrency | pipeline / engine (tok/s) | pipeline / vllm-serve (tok/s) |"
            " pipeline - vllm-serve TTFT p50 |", "|---|---|---|---|"]
    for e, v, p in zip(modes["engine"], modes["vllm-serve"], modes["pipeline"], strict=True):
        out.append(f"| {e['concurrency']} | {p['tokens_per_s'] / e['tokens_per_s']:.0%} | "
                   f"{p['tokens_per_s'] / v['tokens_per_s']:.0%} | "
                   f"{p['ttft_ms']['p50'] - v['ttft_ms']['p50']:+.1f} ms |")
    return "\n".join(out)
