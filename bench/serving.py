"""``pipeline bench serving``: one model and one load, four ways, in one run.

1. **engine**: vLLM's ``AsyncLLM`` in this process (the worker's ``VllmEngine``: the
   chat template and the engine, no HTTP, no Kafka): the ceiling.
2. **worker**: one worker process alone, driven through Kafka: the load generator writes
   ``PromptSubmitted`` to ``chat.prompts`` and reads the turns' events back from
   ``chat.generations`` (no gateway, no projector): what the worker costs next to (1).
3. **vllm-serve**: vLLM's own OpenAI server from the same install, over HTTP/SSE.
4. **pipeline**: gateway, Kafka, worker and projector as processes, over HTTP/SSE:
   what the whole pipeline costs next to (3).
5. **vLLM's benchmark client** (``vllm bench serve --backend openai-chat``'s request
   function, imported unchanged) against (3) and (4), paired the same way: the figures
   that client reports (its TTFT, its ITL between chunks, its failures) for both servers.

Beside (3) and (4), the CPU each side's processes used per streamed token, EngineCore
left out on both: ``vllm serve``'s API server process (HTTP, the chat template,
detokenising, streaming), against the pipeline's processes (gateway, the worker's own
process, projector, broker, PostgreSQL): what the pipeline's plumbing costs as a ratio of
the frontend a user would run anyway.
6. **sim-engine** and **sim-worker**: (1) and (2) again with the SIMULATED engine
   (``workers.sim_engine``, ``SIM_TOKENS_PER_S`` per sequence), which uses no CPU:
   the worker's own cost when the model does not compete with the broker and the
   worker for this machine's cores, as on a GPU host.

Each is a closed loop at each concurrency level, with the same engine arguments, the
same prompt and ``max_tokens`` generated in full (``ignore_eos``). The modes are
compared in pairs, (1) with (2), then (3) with (4): both sides of a pair are up at
once, and their measured rounds alternate (which goes first alternates too), so each
pair of adjacent rounds sees the same machine. On a shared host whose speed drifts by
tens of percent from minute to minute, the ratio of each pair is far steadier than
either figure alone; the report gives their median. Only one side runs at a time: the
other's engine idles (vLLM's model process polls for 1 s after its last step, so the
rounds are ``SETTLE_S`` apart). Each level starts with one unmeasured round per side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput,
    async_request_openai_chat_completions,
)

from bench.capacity import _cpu_s, _processes
from bench.loadgen import (
    Load,
    MakeRequest,
    Request,
    Summary,
    chat_body,
    http_client,
    run_load,
    stream_once,
)
from bench.stack import wait_projected
from gateway.ids import completion_id
from infra.process import free_port, wait_http
from pipeline.codec import CLEAR, key_of, parse, parse_live
from pipeline.kafka import QUICK_ASSIGN, EventProducer, LogReader
from pipeline.topics import GENERATIONS, LIVE, PROMPTS
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    PromptSubmitted,
    SamplingParams,
)
from schemas.live import Start, entries
from workers.engine import Engine, EngineRequest
from workers.host import lower_engine_priority, lower_session_priority, move_off_engine_cores
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine
from workers.vllm_engine import VllmEngine, engine_nice, isolate_engine_cores, vllm_cpu_build

PROMPT = "Write a long story about a log that remembers everything."
MODES = ("engine", "worker", "vllm-serve", "pipeline", "sim-engine", "sim-worker")
LABELS = {"sim-engine": "engine (SIMULATED)", "sim-worker": "worker (SIMULATED engine)"}
# The simulated engine's rate per sequence: four times its default (a GPU serving a
# small model), which keeps rounds short and asks more of the worker.
SIM_TOKENS_PER_S = 200.0
SIM_NAME = "sim"

# Between rounds: vLLM's model process polls for 1 s after its last step.
SETTLE_S = 1.5
# The worker's vLLM front-end process, as its CPU meter is named in the figures.
FRONTEND = "its vLLM front-end process"


def rounds(concurrency: int, quick: bool) -> int:
    """Requests per client in one measured round: a few seconds of work at any level."""
    return max(2 if quick else 4, (32 if quick else 64) // concurrency)


def pairs(quick: bool) -> int:
    return 3 if quick else 5


@dataclass
class Paired:
    """Two modes measured in alternating rounds: each one's summary per level, and per
    level the ratio (b's tokens/s / a's) of each pair of adjacent rounds; with CPU
    meters, each side's CPU µs per output token per level, over its measured rounds."""

    a: list[Summary]
    b: list[Summary]
    ratios: list[list[float]]
    cpu_us_per_token: tuple[list[float], list[float]] = ((), ())  # type: ignore[assignment]
    # Further meters read over b's rounds: each one's CPU µs per b's output token.
    also_us_per_token: dict[str, list[float]] = field(default_factory=dict)


CpuMeter = Callable[[], float]  # a side's processes' CPU seconds so far


async def paired(a: MakeRequest, b: MakeRequest, levels: list[int], quick: bool,
                 per_client: int | None = None, names: tuple[str, str] = ("a", "b"),
                 cpu: tuple[CpuMeter, CpuMeter] | None = None,
                 also: dict[str, CpuMeter] | None = None) -> Paired:
    """``per_client``: requests per client in a round (default ``rounds``); ``names``:
    the two modes', for the progress lines; ``cpu``: each side's CPU meter; ``also``:
    more meters, read over b's rounds."""
    also = also or {}
    out = Paired([], [], [], ([], []), {name: [] for name in also})
    for c in levels:
        n = per_client or rounds(c, quick)
        for make in (a, b):  # unmeasured
            await run_load(make, c, 1)
            await asyncio.sleep(SETTLE_S)
        loads, level = (Load(c), Load(c)), []
        used = [0.0, 0.0]
        used_also = dict.fromkeys(also, 0.0)
        for i in range(pairs(quick)):
            rates = [0.0, 0.0]
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                before = cpu[side]() if cpu else 0.0
                before_also = {name: meter() for name, meter in also.items()} if side else {}
                load = await run_load((a, b)[side], c, n)
                used[side] += cpu[side]() - before if cpu else 0.0
                for name, start in before_also.items():
                    used_also[name] += also[name]() - start
                rates[side] = load.tokens_per_s
                loads[side].add(load)
                await asyncio.sleep(SETTLE_S)
            level.append(rates[1] / rates[0])
            print(f"serving: {names[1]} / {names[0]} at {c} clients, pair {i + 1} of "
                  f"{pairs(quick)}: {rates[1]:,.0f} / {rates[0]:,.0f} tokens/s = {level[-1]:.0%}",
                  flush=True)
        out.a.append(loads[0].summary())
        out.b.append(loads[1].summary())
        out.ratios.append(level)
        for side in (0, 1):
            tokens = loads[side].summary().output_tokens
            out.cpu_us_per_token[side].append(used[side] / tokens * 1e6 if tokens else 0.0)
        tokens = loads[1].summary().output_tokens
        for name in also:
            out.also_us_per_token[name].append(used_also[name] / tokens * 1e6 if tokens
                                               else 0.0)
    return out


def cpu_meter(pids: Callable[[], set[int]]) -> CpuMeter:
    """The CPU seconds the processes ``pids()`` names have used (each read from /proc)."""
    def used() -> float:
        total = 0.0
        for pid in pids():
            with contextlib.suppress(OSError):
                total += _cpu_s(pid)
        return total

    return used





@contextlib.asynccontextmanager
async def engine_client(engine: Engine, max_tokens: int, prompt: str = PROMPT
                        ) -> AsyncIterator[MakeRequest]:
    """Requests straight into an engine in this process; closes it after."""
    messages = (ChatMessage(role="user", content=prompt),)

    async def one(seed: int) -> Request:
        request = Request(time.perf_counter())
        sampling = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)

        def take(text: str, token_ids: tuple[int, ...], *_: object) -> None:
            if token_ids and request.first is None:
                request.first = time.perf_counter()
            request.tokens += len(token_ids)

        await engine.run(EngineRequest(uuid.uuid4().hex, messages, sampling), take)
        request.ended = time.perf_counter()
        return request

    try:
        yield one
    finally:
        engine.close()


@contextlib.asynccontextmanager
async def http_client_for(url: str, name: str, max_tokens: int, connections: int,
                          prompt: str = PROMPT) -> AsyncIterator[MakeRequest]:
    """Streaming chat requests to an OpenAI-compatible server."""
    async with http_client(connections) as client:
        async def one(seed: int) -> Request:
            return await stream_once(client, url, chat_body(name, prompt, max_tokens, seed))

        yield one


@contextlib.asynccontextmanager
async def vllm_bench_client(url: str, name: str, max_tokens: int, connections: int,
                            prompt: str = PROMPT) -> AsyncIterator[MakeRequest]:
    """Requests made by vLLM's own benchmark client, its results as it measured them."""
    async with http_client(connections) as client:
        async def one(seed: int) -> Request:
            out = await async_request_openai_chat_completions(RequestFuncInput(
                prompt=prompt, api_url=f"{url}/v1/chat/completions", prompt_len=0,
                output_len=max_tokens, model=name, ignore_eos=True,
                extra_body={"seed": seed}), client)
            request = Request(out.start_time)
            if not out.success:
                request.error = (out.error.strip().splitlines() or ["failed"])[-1][:200]
                return request
            request.first, request.ended = out.start_time + out.ttft, \
                out.start_time + out.latency
            request.tokens, request.chunk_gaps = out.output_tokens, list(out.itl)
            return request

        yield one


@contextlib.asynccontextmanager
async def kafka_client(bootstrap: str, name: str, max_tokens: int, prompt: str = PROMPT
                       ) -> AsyncIterator[MakeRequest]:
    """Prompts into ``chat.prompts``; each turn's first token read from its start entry in
    ``chat.live`` (written with its first delta), its end from ``chat.generations``."""
    producer = EventProducer(bootstrap, linger_ms=0)
    reader = LogReader(bootstrap, f"bench-worker-{uuid.uuid4().hex[:8]}", "bench",
                       **QUICK_ASSIGN)
    waiting: dict[str, tuple[Request, asyncio.Future[None]]] = {}

    def first_tokens(value: bytes | None, now: float) -> None:
        for _, _, item in entries(parse_live(value)):
            entry = waiting.get(item.request_id) if isinstance(item, Start) else None
            if entry is not None and entry[0].first is None:
                entry[0].first = now

    async def read() -> None:
        while True:
            for record in await reader.poll_batch(1000, 0.05):
                now = time.perf_counter()
                if record.position.topic == LIVE:
                    first_tokens(record.value, now)
                    continue
                event = parse(record.value)
                entry = waiting.get(getattr(event, "request_id", ""))
                if entry is None:
                    continue
                request, done = entry
                if isinstance(event, GenerationFinished):
                    request.tokens, request.ended = event.usage.completion_tokens, now
                    done.set_result(None)
                elif isinstance(event, GenerationFailed):
                    request.error = event.code
                    done.set_result(None)

    async def one(seed: int) -> Request:
        conversation = uuid.uuid4()
        submitted = PromptSubmitted(
            conversation_id=conversation, request_id=completion_id(conversation),
            tenant="bench", model=name, messages=(ChatMessage(role="user", content=prompt),),
            sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True))
        request = Request(time.perf_counter())
        done = asyncio.get_running_loop().create_future()
        waiting[submitted.request_id] = (request, done)
        try:
            await producer.send_raw(PROMPTS, key_of(submitted), CLEAR.encode(submitted))
            await asyncio.wait_for(done, timeout=600)
        finally:
            del waiting[submitted.request_id]
        return request

    await reader.follow_from_end(LIVE)
    await reader.follow_from_end(GENERATIONS)
    reading = asyncio.create_task(read())
    try:
        yield one
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await reader.close()
        producer.close()


def engine_flags(settings: WorkerSettings) -> list[str]:
    """The engine arguments, as the worker's command and ``vllm serve`` both take them."""
    flags = ["--max-num-seqs", str(settings.max_num_seqs), "--dtype", settings.dtype]
    if settings.max_model_len:
        flags += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(settings.max_num_batched_tokens)]
    if settings.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization)]
    elif settings.kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes)]
    if settings.load_format != "auto":
        flags += ["--load-format", settings.load_format]
    return flags


def serve_only_flags() -> list[str]:
    """What ``vllm serve`` needs to schedule as the worker's engine does: with a CPU
    build of vLLM the worker never splits a prefill over steps (``engine_args``)."""
    return ["--no-enable-chunked-prefill"] if vllm_cpu_build() else []


def prompt_of(tokens: int | None) -> str:
    """A user message of about ``tokens`` tokens (one word each; the chat template adds
    its own), or the default prompt."""
    return PROMPT if tokens is None else " ".join(["log"] * tokens)


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


async def run(settings: WorkerSettings, bootstrap: str, model: Path, name: str,
              levels: list[int], max_tokens: int, quick: bool, log_dir: Path,
              prompt: str = PROMPT) -> dict[str, Any]:
    """The engine paired with one worker process alone; then vllm serve paired with the
    pipeline (that worker, with a projector and a gateway started beside it)."""
    exe = [sys.executable, "-m", "launch"]
    flags = engine_flags(settings)
    # The worker starts first: the in-process engine then moves this process off the
    # engine's cores, which a child started later would inherit.
    procs = _start({"worker": [*exe, "worker", "--model", str(model), "--served-model-name",
                               name, *flags]}, log_dir)
    try:
        async with kafka_client(bootstrap, name, max_tokens, prompt) as worker, \
                engine_client(VllmEngine(settings, model, name), max_tokens,
                              prompt) as engine:
            # The worker's process alone (vLLM's front end and engine are its children), per
            # token, and its front end's; beside them this process: the load generator and
            # AsyncLLM's output processing.
            first = await paired(engine, worker, levels, quick, names=("engine", "worker"),
                                 cpu=(cpu_meter(lambda: {os.getpid()}),
                                      cpu_meter(lambda: {procs[0].pid})),
                                 also={FRONTEND: cpu_meter(lambda: frontend_pids(procs[0].pid))})
        port, serve_port = free_port(), free_port()
        serve = _start({"vllm-serve": [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(serve_port),
            *flags, *serve_only_flags()]}, log_dir)[0]
        procs += [serve, *_start({"projector": [*exe, "projector"],
                                  "gateway": [*exe, "gateway", "--port", str(port)]}, log_dir)]
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{serve_port}/health", procs, 300)
        # vllm serve's engine gets what the worker gives its own: a lower priority, and
        # its API server keeps off the engine's compute cores.
        lower_engine_priority(serve.pid, engine_nice(settings))
        lower_session_priority(serve.pid, engine_nice(settings))
        if isolate_engine_cores(settings):
            move_off_engine_cores(serve.pid)
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health", procs, 120)
        await asyncio.to_thread(wait_projected, bootstrap)
        connections = max(levels) + 8
        # EngineCore left out on both sides: vllm serve's API server process alone (its
        # engine is a child process), against the pipeline's processes with the worker's
        # own (its engine is a child process too).
        ours = {procs[-1].pid, procs[0].pid, procs[-2].pid}  # gateway, worker, projector
        plumbing = cpu_meter(lambda: {*ours, *frontend_pids(procs[0].pid), *_infra_pids()})
        frontend = cpu_meter(lambda: {serve.pid})
        async with http_client_for(f"http://127.0.0.1:{serve_port}", name, max_tokens,
                                   connections, prompt) as vllm_serve, \
                http_client_for(f"http://127.0.0.1:{port}", name, max_tokens,
                                connections, prompt) as pipeline:
            second = await paired(vllm_serve, pipeline, levels, quick,
                                  names=("vllm serve", "pipeline"), cpu=(frontend, plumbing))
        async with vllm_bench_client(f"http://127.0.0.1:{serve_port}", name, max_tokens,
                                     connections, prompt) as vllm_serve, \
                vllm_bench_client(f"http://127.0.0.1:{port}", name, max_tokens,
                                  connections, prompt) as pipeline:
            clients = await paired(vllm_serve, pipeline, levels, quick, per_client=2,
                                   names=("vllm serve, vLLM's client", "pipeline, vLLM's client"))
    finally:
        _stop(procs)
    third = await _paired_simulated(bootstrap, levels, max_tokens, quick, log_dir, prompt)
    return {"model": name, "max_tokens": max_tokens, "max_num_seqs": settings.max_num_seqs,
            "load_format": settings.load_format, "dtype": settings.dtype,
            "prompt_words": len(prompt.split()),
            "max_model_len": settings.max_model_len, "pairs": pairs(quick),
            "modes": {mode: [s.to_json() for s in summaries] for mode, summaries in (
                ("engine", first.a), ("worker", first.b),
                ("vllm-serve", second.a), ("pipeline", second.b),
                ("sim-engine", third.a), ("sim-worker", third.b))},
            "vllm_client": {"vllm-serve": [s.to_json() for s in clients.a],
                            "pipeline": [s.to_json() for s in clients.b]},
            "cpu_us_per_token": {"vllm serve's API server": second.cpu_us_per_token[0],
                                 "the pipeline's processes": second.cpu_us_per_token[1]},
            "worker_cpu_us_per_token": {"vLLM worker's process": first.cpu_us_per_token[1],
                                        FRONTEND: first.also_us_per_token[FRONTEND],
                                        "SIMULATED worker's process":
                                            third.cpu_us_per_token[1]},
            "sim_tokens_per_s": SIM_TOKENS_PER_S,
            "ratios": {"worker / engine": first.ratios,
                       "pipeline / vllm-serve": second.ratios,
                       "pipeline / vllm-serve, vLLM's client": clients.ratios,
                       "sim-worker / sim-engine": third.ratios}}


async def _paired_simulated(bootstrap: str, levels: list[int], max_tokens: int, quick: bool,
                            log_dir: Path, prompt: str = PROMPT) -> Paired:
    """The SIMULATED engine in this process paired with a worker process running it
    (the vLLM worker has left the group by now, so this one takes every prompt)."""
    env = {**os.environ, "WORKER_SIM_TOKENS_PER_S": str(SIM_TOKENS_PER_S),
           "WORKER_SERVED_MODEL_NAME": SIM_NAME}
    procs = _start({"sim-worker": [sys.executable, "-m", "launch", "worker",
                                   "--engine", "sim"]}, log_dir, env)
    try:
        async with kafka_client(bootstrap, SIM_NAME, max_tokens, prompt) as worker, \
                engine_client(SimEngine(SIM_NAME, tokens_per_s=SIM_TOKENS_PER_S,
                                        max_num_seqs=max(256, *levels)),
                              max_tokens, prompt) as engine:
            return await paired(engine, worker, levels, quick, per_client=2 if quick else 4,
                                names=("SIMULATED engine", "SIMULATED worker"),
                                cpu=(cpu_meter(lambda: {os.getpid()}),
                                     cpu_meter(lambda: {procs[0].pid})))
    finally:
        _stop(procs)


def frontend_pids(worker: int) -> set[int]:
    """The vLLM front-end process of worker process ``worker`` (none when it runs vLLM's
    front end in its own process, ``WORKER_VLLM_FRONTEND=inline``)."""
    return {pid for pid, (parent, cmd) in _processes().items()
            if parent == worker and "workers.vllm_frontend" in cmd}


def _infra_pids() -> set[int]:
    """The broker's and PostgreSQL's processes (as the capacity bench finds them)."""
    procs = _processes()
    return {p for p, (_, cmd) in procs.items()
            if ("java" in cmd and "kafka" in cmd.lower())
            or cmd.split(" ", 1)[0].endswith("postgres") or cmd.startswith("postgres:")}


def bench(settings: WorkerSettings, bootstrap: str, model: Path, name: str,
          levels: list[int], max_tokens: int, quick: bool, log_dir: Path,
          prompt: str = PROMPT) -> dict[str, Any]:
    return asyncio.run(run(settings, bootstrap, model, name, levels, max_tokens, quick,
                           log_dir, prompt))


def tables(figures: dict[str, Any]) -> str:
    """The serving figures as markdown: one table per concurrency level (each mode over
    all its measured rounds), then the paired ratios."""
    modes = figures["modes"]
    out = []
    for i, level in enumerate(modes["engine"]):
        c = level["concurrency"]
        out += [f"**Concurrency {c}** ({figures['max_tokens']} tokens per request)", "",
                "| | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) | end-to-end p50 / p99 (ms)"
                " | output tok/s | req/s | failures | client CPU |",
                "|---|---|---|---|---|---|---|---|"]
        for mode in MODES:
            s = modes[mode][i]
            label = LABELS.get(mode, mode)
            t, itl, e2e = s["ttft_ms"], s["itl_ms"], s["latency_ms"]
            out.append(f"| {label} | {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | "
                       f"{itl['p50']:.2f} / {itl['p99']:.2f} | {e2e['p50']:.0f} / "
                       f"{e2e['p99']:.0f} | {s['tokens_per_s']:,.0f} | "
                       f"{s['requests_per_s']:.1f} | {s['failures']} | "
                       f"{s['client_cpu']:.0%} |")
        out.append("")
    n = figures["pairs"]
    out += [f"| concurrency | worker / engine tok/s, median of {n} paired rounds (range) |"
            f" pipeline / vllm-serve tok/s, median of {n} paired rounds (range) |"
            " pipeline - vllm-serve TTFT p50 |"
            " worker / engine tok/s, SIMULATED engine (range) |"
            " worker - engine TTFT p50, SIMULATED engine |",
            "|---|---|---|---|---|---|"]
    ratios = figures["ratios"]

    def spread(values: list[float], digits: int = 0) -> str:
        def pc(x: float) -> str:
            return f"{x:.{digits}%}"

        return f"{pc(statistics.median(values))} ({pc(min(values))}-{pc(max(values))})"

    def ttft_gap(a: dict[str, Any], b: dict[str, Any]) -> str:
        return f"{b['ttft_ms']['p50'] - a['ttft_ms']['p50']:+.1f} ms"

    for i, v in enumerate(modes["vllm-serve"]):
        out.append(f"| {v['concurrency']} | {spread(ratios['worker / engine'][i])} | "
                   f"{spread(ratios['pipeline / vllm-serve'][i])} | "
                   f"{ttft_gap(v, modes['pipeline'][i])} | "
                   f"{spread(ratios['sim-worker / sim-engine'][i], 1)} | "
                   f"{ttft_gap(modes['sim-engine'][i], modes['sim-worker'][i])} |")
    if "vllm_client" in figures:
        out += ["", *client_table(figures["vllm_client"],
                                  ratios["pipeline / vllm-serve, vLLM's client"], spread)]
    # Whether the worker ran vLLM's front end in a process of its own (a GPU build's
    # default) or in its own process (a CPU build's).
    front_apart = any(figures.get("worker_cpu_us_per_token", {}).get(FRONTEND) or [])
    where = ("a process of its own beside the worker's" if front_apart
             else "in the worker's own process, as with a CPU build of vLLM")
    if "cpu_us_per_token" in figures:
        cpu = figures["cpu_us_per_token"]
        frontend, plumbing = cpu["vllm serve's API server"], cpu["the pipeline's processes"]
        out += ["", "**CPU per streamed token**, EngineCore left out on both sides (the "
                f"pipeline's side holds vLLM's own front end too: {where})", "",
                "| concurrency | vllm serve's API server (µs/token) | the pipeline's processes:"
                " gateway, worker, projector, broker, PostgreSQL (µs/token) | pipeline / vllm "
                "serve |", "|---|---|---|---|"]
        for v, f, pl in zip(modes["vllm-serve"], frontend, plumbing, strict=True):
            out.append(f"| {v['concurrency']} | {f:,.0f} | {pl:,.0f} | "
                       f"{pl / f if f else float('nan'):.2f}x |")
    if "worker_cpu_us_per_token" in figures:
        worker = figures["worker_cpu_us_per_token"]
        out += ["", "**The worker's process, CPU per generated token** (its engine's process "
                "left out; vLLM's front end, its output processing and detokenising: "
                f"{where}; the target is 20 µs)", "",
                "| concurrency | vLLM worker (µs/token) | its vLLM front end (µs/token) | "
                "SIMULATED worker (µs/token) |", "|---|---|---|---|"]
        front = worker.get(FRONTEND, [float("nan")] * len(modes["engine"]))
        for v, real, fe, sim in zip(modes["engine"], worker["vLLM worker's process"], front,
                                    worker["SIMULATED worker's process"], strict=True):
            apart = f"{fe:,.1f}" if fe else "none: in the worker's process"
            out.append(f"| {v['concurrency']} | {real:,.1f} | {apart} | {sim:,.1f} |")
    return "\n".join(out)


def client_table(sides: dict[str, list[dict[str, Any]]], ratios: list[list[float]],
                 spread: Callable[[list[float]], str]) -> list[str]:
    """What vLLM's benchmark client reports against vllm serve and against the pipeline."""
    out = ["**vLLM's benchmark client** (`vllm bench serve --backend openai-chat`'s request "
           "function), the same load against both servers", "",
           "| concurrency | server | TTFT p50 / p99 (ms) | ITL between chunks p50 / p99 (ms) |"
           " output tok/s | failures | tok/s, pipeline / vllm-serve (range) |",
           "|---|---|---|---|---|---|---|"]
    for i, (serve, ours) in enumerate(zip(sides["vllm-serve"], sides["pipeline"],
                                          strict=True)):
        for label, s in (("vllm serve", serve), ("pipeline", ours)):
            t, itl = s["ttft_ms"], s["chunk_itl_ms"]
            out.append(f"| {s['concurrency']} | {label} | {t['p50']:.1f} / {t['p99']:.1f} | "
                       f"{itl['p50']:.2f} / {itl['p99']:.2f} | {s['tokens_per_s']:,.0f} | "
                       f"{s['failures']} of {s['requests']} | "
                       + (spread(ratios[i]) if label == "pipeline" else "") + " |")
    return out
