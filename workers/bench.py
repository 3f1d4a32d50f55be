"""``pipeline bench worker``: one vLLM worker's output tokens/s through the whole pipeline,
next to the same load driven straight into AsyncLLM in one process.

Closed loop: at each concurrency level, that many clients each send requests one
after another. Phase 1 runs the engine in this process (the worker's own
``VllmEngine``: AsyncLLM plus the chat template, no Kafka). Phase 2 starts a worker,
a gateway and a projector as processes on the local stack (``pipeline infra up``) and
drives streaming HTTP requests through them. Both phases use the same engine
arguments, prompts and sampling; the broker and PostgreSQL run throughout.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from infra.process import wait_http
from pipeline.settings import WorkerSettings
from schemas import ChatMessage, SamplingParams
from workers.engine import EngineRequest

PROMPT = "Write a long story about a log that remembers everything."


@dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _rounds(concurrency: int) -> int:
    return max(2, 16 // concurrency)


async def run_direct(settings: WorkerSettings, model: Path, name: str, levels: list[int],
                     max_tokens: int) -> list[Level]:
    from workers.vllm_engine import VllmEngine

    engine = VllmEngine(settings, model, name)
    messages = (ChatMessage(role="user", content=PROMPT),)
    counter = 0

    async def one(seed: int) -> int:
        nonlocal counter
        counter += 1
        request = EngineRequest(f"direct-{counter}", messages,
                                SamplingParams(max_tokens=max_tokens, seed=seed))
        return sum([len(out.token_ids) async for out in engine.generate(request)])

    try:
        await one(0)  # warm-up
        results = []
        for c in levels:
            async def client(i: int, c: int = c) -> int:
                return sum([await one(i * 100 + k) for k in range(_rounds(c))])
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(client(i) for i in range(c))))
            results.append(Level(c, c * _rounds(c), tokens, time.perf_counter() - started))
        return results
    finally:
        engine.close()


async def run_pipeline(url: str, model: str, levels: list[int],
                       max_tokens: int) -> list[Level]:
    async def one(client: httpx.AsyncClient, seed: int) -> int:
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "seed": seed,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": PROMPT}]}
        tokens = 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, 0)  # warm-up
        results = []
        for c in levels:
            async def loop(i: int, c: int = c) -> int:
                return sum([await one(client, i * 100 + k) for k in range(_rounds(c))])
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(loop(i) for i in range(c))))
            results.append(Level(c, c * _rounds(c), tokens, time.perf_counter() - started))
        return results


def bench(settings: WorkerSettings, model: Path, name: str, levels: list[int], max_tokens: int,
          port: int, log_dir: Path) -> dict[str, object]:
    direct = asyncio.run(run_direct(settings, model, name, levels, max_tokens))
    log_dir.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "pipeline"]
    worker_args = ["--max-num-seqs", str(settings.max_num_seqs),
                   "--max-model-len", str(settings.max_model_len)]
    procs = []
    logs = [open(log_dir / f"bench-{name}.log", "wb") for name in ("projector", "worker",
                                                                    "gateway")]
    for cmd, log in zip((["projector"], ["worker", *worker_args],
                         ["gateway", "--port", str(port)]), logs, strict=True):
        procs.append(subprocess.Popen([*exe, *cmd], stdout=log, stderr=subprocess.STDOUT))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", procs, timeout=120)
        cpu = time.process_time()
        through = asyncio.run(run_pipeline(url, name, levels, max_tokens))
        client_cpu = time.process_time() - cpu
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        for log in logs:
            log.close()
    wall = sum(level.seconds for level in through)
    return {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": name, "max_tokens": max_tokens,
        "max_num_seqs": settings.max_num_seqs, "max_model_len": settings.max_model_len,
        "direct": [asdict(x) | {"tokens_per_s": x.tokens_per_s} for x in direct],
        "pipeline": [asdict(x) | {"tokens_per_s": x.tokens_per_s} for x in through],
        "client_cpu_share": client_cpu / wall,
    }


def report(figures: dict[str, object], out_dir: Path) -> str:
    direct = {d["concurrency"]: d for d in figures["direct"]}  # type: ignore[attr-defined]
    rows = ["| concurrency | AsyncLLM in one process | through the pipeline | ratio |",
            "|---|---|---|---|"]
    for p in figures["pipeline"]:  # type: ignore[attr-defined]
        d = direct[p["concurrency"]]
        ratio = p["tokens_per_s"] / d["tokens_per_s"]
        rows.append(f"| {p['concurrency']} | {d['tokens_per_s']:,.0f} tok/s | "
                    f"{p['tokens_per_s']:,.0f} tok/s | {ratio:.0%} |")
    table = "\n".join(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "worker.json").write_text(json.dumps(figures, indent=2) + "\n")
    (out_dir / "worker.md").write_text(
        f"# Worker throughput ({figures['measured_at']})\n\n{table}\n\n"
        f"Model {figures['model']}, max_tokens {figures['max_tokens']}, max_num_seqs "
        f"{figures['max_num_seqs']}, on 2 cores shared by the engine, the broker, PostgreSQL,\n"
        "the gateway, the projector and the load generator (whose CPU share was "
        f"{figures['client_cpu_share']:.0%} of one core). Measured with `pipeline bench worker`.\n")
    return table
