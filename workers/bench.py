"""``pipeline bench serving``: one model and one load, three ways, in one run.

1. **engine**: vLLM's ``AsyncLLM`` in this process (the worker's ``VllmEngine``: the
   chat template and the engine, no HTTP, no Kafka): the ceiling.
2. **worker**: one worker process alone, driven through Kafka: the load generator writes
   ``PromptSubmitted`` to ``chat.prompts`` and reads the turns' events back from
   ``chat.generations`` (no gateway, no projector): what the worker costs next to (1).
3. **vllm-serve**: vLLM's own OpenAI server from the same install, over HTTP/SSE.
4. **pipeline**: gateway, Kafka, worker and projector as processes, over HTTP/SSE:
   what the whole pipeline costs next to (3).

Each is a closed loop at each concurrency level, with the same engine arguments, the
same prompt and ``max_tokens`` generated in full (``ignore_eos``). They run one after
another, so they never share the CPU; the broker and PostgreSQL run throughout. Each
level starts with one unmeasured round at its concurrency.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from gateway.ids import completion_id
from infra.process import free_port, wait_http
from pipeline.codec import decode
from pipeline.kafka import QUICK_ASSIGN, AsyncConsumer, EventProducer, GroupStatus
from pipeline.loadgen import (
    MakeRequest,
    Request,
    Summary,
    chat_body,
    closed_loop,
    http_client,
    stream_once,
)
from pipeline.settings import ProjectorSettings, WorkerSettings
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    SamplingParams,
    TokenDelta,
)
from workers.engine import EngineRequest
from workers.vllm_engine import engine_nice, lower_engine_priority

PROMPT = "Write a long story about a log that remembers everything."
MODES = ("engine", "worker", "vllm-serve", "pipeline")


def rounds(concurrency: int, quick: bool) -> int:
    """Requests per client: enough for steady figures, at least 16 requests a level."""
    return max(2 if quick else 4, (16 if quick else 32) // concurrency)


async def measure(one: MakeRequest, levels: list[int], quick: bool) -> list[Summary]:
    """Each level: one round unmeasured at its concurrency, then the measured rounds. (The
    first rounds after start-up had TTFT p90s of 200-800 ms here, later ones 40-65 ms.)"""
    out = []
    for c in levels:
        await closed_loop(one, c, 1)
        out.append(await closed_loop(one, c, rounds(c, quick)))
    return out


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
        return await measure(one, levels, quick)
    finally:
        engine.close()


async def run_http(url: str, name: str, levels: list[int], max_tokens: int,
                   quick: bool) -> list[Summary]:
    async with http_client(max(levels) + 8) as client:
        async def one(seed: int) -> Request:
            return await stream_once(client, url, chat_body(name, PROMPT, max_tokens, seed))

        return await measure(one, levels, quick)


async def run_kafka(bootstrap: str, name: str, levels: list[int], max_tokens: int,
                    quick: bool) -> list[Summary]:
    """Closed loop straight through Kafka: prompts in, the worker's events out."""
    producer = EventProducer(bootstrap, linger_ms=0)
    reader = AsyncConsumer(bootstrap, f"bench-worker-{uuid.uuid4().hex[:8]}", **QUICK_ASSIGN)
    waiting: dict[str, tuple[Request, asyncio.Future[None]]] = {}

    async def read() -> None:
        while True:
            for record in await reader.poll_batch(1000, 0.05):
                now = time.perf_counter()
                event = decode(record.value)
                entry = waiting.get(getattr(event, "request_id", ""))
                if entry is None:
                    continue
                request, done = entry
                if isinstance(event, TokenDelta) and request.first is None:
                    request.first = now
                elif isinstance(event, GenerationFinished):
                    request.tokens, request.ended = event.usage.completion_tokens, now
                    done.set_result(None)
                elif isinstance(event, GenerationFailed):
                    request.error = event.code
                    done.set_result(None)

    async def one(seed: int) -> Request:
        conversation = uuid.uuid4()
        prompt = PromptSubmitted(
            conversation_id=conversation, request_id=completion_id(conversation),
            tenant="bench", model=name, messages=(ChatMessage(role="user", content=PROMPT),),
            sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True))
        request = Request(time.perf_counter())
        done = asyncio.get_running_loop().create_future()
        waiting[prompt.request_id] = (request, done)
        try:
            await producer.send(PROMPTS, prompt)
            await asyncio.wait_for(done, timeout=600)
        finally:
            del waiting[prompt.request_id]
        return request

    await reader.call(reader.follow_from_end_sync, GENERATIONS)
    reading = asyncio.create_task(read())
    try:
        return await measure(one, levels, quick)
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await reader.close()
        producer.close()


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
        # The same as the worker and the engine mode give their engine processes.
        lower_engine_priority(procs[0].pid, engine_nice(settings))
        return asyncio.run(run_http(f"http://127.0.0.1:{port}", name, levels, max_tokens,
                                    quick))
    finally:
        _stop(procs)


def _wait_projected(bootstrap: str, timeout: float = 600.0) -> None:
    """Until the projector has caught up with the log (the turns just run through the
    worker alone, and whatever came before), so its catching up is not measured."""
    status = GroupStatus(bootstrap, ProjectorSettings().group)
    deadline = time.monotonic() + timeout
    try:
        while True:
            behind = sum(max(end - at, 0) for topic in (PROMPTS, GENERATIONS)
                         for at, end in status.per_partition(topic).values())
            if behind < 100:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the projector is still {behind} records behind")
            print(f"waiting for the projector to catch up: {behind:,} records behind",
                  flush=True)
            time.sleep(2)
    finally:
        status.close()


def run_pipeline(settings: WorkerSettings, bootstrap: str, name: str, levels: list[int],
                 max_tokens: int, quick: bool, log_dir: Path
                 ) -> tuple[list[Summary], list[Summary]]:
    """One worker process: first alone, driven through Kafka; then with a projector and a
    gateway started beside it, over HTTP/SSE."""
    port = free_port()
    exe = [sys.executable, "-m", "pipeline"]
    procs = _start({"worker": [*exe, "worker", *_engine_flags(settings)]}, log_dir)
    try:
        alone = asyncio.run(run_kafka(bootstrap, name, levels, max_tokens, quick))
        procs += _start({"projector": [*exe, "projector"],
                         "gateway": [*exe, "gateway", "--port", str(port)]}, log_dir)
        wait_http(f"http://127.0.0.1:{port}/health", procs, timeout=120)
        _wait_projected(bootstrap)
        return alone, asyncio.run(run_http(f"http://127.0.0.1:{port}", name, levels,
                                           max_tokens, quick))
    finally:
        _stop(procs)


def bench(settings: WorkerSettings, bootstrap: str, model: Path, name: str,
          levels: list[int], max_tokens: int, quick: bool, log_dir: Path) -> dict[str, Any]:
    results = {
        "engine": asyncio.run(run_engine(settings, model, name, levels, max_tokens, quick)),
        "vllm-serve": run_vllm_serve(settings, model, name, levels, max_tokens, quick, log_dir),
    }
    results["worker"], results["pipeline"] = run_pipeline(
        settings, bootstrap, name, levels, max_tokens, quick, log_dir)
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
    out += ["| concurrency | worker / engine (tok/s) | pipeline / engine (tok/s) |"
            " pipeline / vllm-serve (tok/s) | pipeline - vllm-serve TTFT p50 |",
            "|---|---|---|---|---|"]
    for e, w, v, p in zip(*(modes[m] for m in MODES), strict=True):
        out.append(f"| {e['concurrency']} | {w['tokens_per_s'] / e['tokens_per_s']:.0%} | "
                   f"{p['tokens_per_s'] / e['tokens_per_s']:.0%} | "
                   f"{p['tokens_per_s'] / v['tokens_per_s']:.0%} | "
                   f"{p['ttft_ms']['p50'] - v['ttft_ms']['p50']:+.1f} ms |")
    return "\n".join(out)
