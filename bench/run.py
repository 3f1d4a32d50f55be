"""``pipeline bench``: the benchmark programs, run in sequence on the local stack. Each
part prints its table and writes ``<part>.json`` and ``<part>.md`` under the output
folder (``docs/benchmarks`` for a full run, ``.state/bench`` for ``--quick``)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.settings import CommonSettings
from workers.settings import WorkerSettings

PARTS = ("serving", "capacity", "log", "fairness", "projection", "analytics", "sealing",
         "hotpath", "frontend", "worker", "memory")
# Parts run only when named: a year of state takes its own stack and the better part of
# an hour.
NAMED_ONLY = ("scale",)
# The capacity figures of the code before the work on plumbing cost, kept to set beside
# every later run's.
CAPACITY_BEFORE = Path("docs/benchmarks/capacity-before.json")


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}"


def _save(out: Path, part: str, title: str, figures: dict[str, Any], table: str,
          notes: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(figures, indent=2) + "\n")
    (out / f"{part}.md").write_text(
        f"# {title} ({figures['measured_at']})\n\n{table}\n\n{notes}\n")


def _whole_prefills() -> str:
    from workers.vllm_engine import vllm_cpu_build

    if not vllm_cpu_build():
        return ""
    return ("A CPU build of vLLM: every engine of the run computes each prefill in one "
            "step (chunked prefill off, as the worker's, see docs/workers.md). ")


def serving(common: CommonSettings, quick: bool, out: Path,
            resolve_model: Callable[[CommonSettings, WorkerSettings], tuple[Path, str]],
            shape: ServingShape | None = None) -> str:
    from bench import serving as bench

    shape = shape or ServingShape()
    levels = shape.clients or ([8] if quick else [1, 8, 32])
    max_tokens = shape.max_tokens or (64 if quick else 128)
    settings = WorkerSettings(**shape.engine)
    tiny = not settings.model
    settings = settings.model_copy(update={
        "max_num_seqs": settings.max_num_seqs or max(32, *levels),
        "max_model_len": settings.max_model_len or (512 if tiny else None)})
    model, name = resolve_model(common, settings)
    figures = bench.bench(settings, common.kafka_bootstrap, model, name, levels, max_tokens, quick,
                          common.state_dir / "bench-logs", bench.prompt_of(shape.prompt_tokens))
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.tables(figures)
    weights = ("random weights" if tiny or settings.load_format == "dummy"
               else "its weights")
    _save(out, "serving", "Serving: the engine, vllm serve and the pipeline", figures, table,
          f"Model {name} ({weights}, {settings.dtype}), load format {settings.load_format}, "
          f"prompt of {figures['prompt_words']} words, max_num_seqs {figures['max_num_seqs']}, "
          f"max_model_len {figures['max_model_len']}, on {figures['machine']}. "
          f"{_whole_prefills()}Closed loop. Modes in pairs (engine with worker, vllm-serve "
          "with pipeline, then the SIMULATED "
          f"engine at {figures['sim_tokens_per_s']:.0f} tokens/s per sequence with a worker "
          "running it), both up, their measured rounds alternating: one runs while the "
          "other idles. The ratios are the medians of adjacent rounds' ratios. The "
          "simulated engine uses no CPU, as a GPU's compute does not: its pair is the "
          "worker's own cost. The last table is vLLM's own benchmark client "
          "(`vllm.benchmarks.lib.endpoint_request_func.async_request_openai_chat_completions`"
          ", unchanged) against vllm serve and the pipeline, paired the same way, 2 requests "
          "per client a round. Measured with `pipeline bench serving"
          f"{' --quick' if quick else ''}{shape.flags()}`.")
    return table


@dataclass(frozen=True)
class ServingShape:
    """What ``pipeline bench serving`` runs, as its flags say (unset: the defaults, and
    the engine's from the WORKER_* settings)."""

    engine: dict[str, Any] = field(default_factory=dict)  # WorkerSettings fields
    clients: list[int] | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None

    def flags(self) -> str:
        said = [f" --{k.replace('_', '-')} {v}" for k, v in self.engine.items()]
        if self.clients:
            said.append(f" --clients {','.join(map(str, self.clients))}")
        for name in ("max_tokens", "prompt_tokens"):
            if getattr(self, name) is not None:
                said.append(f" --{name.replace('_', '-')} {getattr(self, name)}")
        return "".join(said)


def capacity(common: CommonSettings, quick: bool, out: Path) -> str:
    from bench import capacity as bench

    figures = bench.run(common.kafka_bootstrap, quick, common.state_dir / "bench-logs")
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    before = json.loads(CAPACITY_BEFORE.read_text()) if CAPACITY_BEFORE.exists() else None
    table = bench.tables(figures, before)
    _save(out, "capacity", "Pipeline capacity with the SIMULATED engine", figures, table,
          "The worker is the SIMULATED engine, so the pipeline (gateway, Kafka, worker "
          f"loop, projector) is what is measured, on {figures['machine']}: the load "
          "generator, the broker, PostgreSQL and every process share these cores. One "
          "unrecorded point at 256 x 20 runs first to warm the broker's JIT. The load "
          "generator (aiohttp, one process for all the streams) times each SSE message by "
          "the socket read that completed it and parses the messages after the run. "
          f"Measured with `pipeline bench capacity{' --quick' if quick else ''}`.")
    return table


def log(common: CommonSettings, quick: bool, out: Path, before: Path | None) -> str:
    from bench import log as bench

    scenarios = bench.SCENARIOS[:3] if quick else bench.SCENARIOS
    figures = bench.run(common.kafka_bootstrap, common.state_dir / "kafka",
                        common.state_dir / "bench-logs", before, scenarios)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.tables(figures)
    _save(out, "log", "What the log costs in bytes", figures, table,
          "SIMULATED engine (token i's text is `t<i> `), one broker, replication factor 1: "
          "each topic's log segments on disk (records, batch headers, transaction "
          "markers), grown over the scenario; a replica keeps as much again per replica. "
          "Text: the UTF-8 bytes of the users' messages and of the replies as the clients "
          f"received them. On {figures['machine']}. Measured with `pipeline bench log"
          f"{' --quick' if quick else ''}{' --before PATH' if before else ''}`.")
    return table


@dataclass(frozen=True)
class WorkerLoad:
    """What ``pipeline bench worker`` runs, as its flags say: ``streams`` turns at
    ``rate`` tokens/s each; with ``trees`` (side A's and B's checkouts), ``pairs`` pairs."""

    streams: int = 256
    rate: float = 100.0
    trees: dict[str, Path | None] | None = None
    pairs: int = 2

    def flags(self) -> str:
        said = f" --streams {self.streams} --rate {self.rate:g}"
        for side, tree in (self.trees or {}).items():
            said += f" --{side.lower()}-tree {tree}" if tree is not None else ""
        return said + (f" --pairs {self.pairs}" if self.trees else "")


def worker(common: CommonSettings, quick: bool, out: Path, load: WorkerLoad) -> str:
    from bench import worker as bench
    from pipeline.keystore import open_keyring

    with open_keyring(common, "bench-worker") as keyring:
        logs = common.state_dir / "bench-logs"
        if load.trees:
            figures = bench.paired(common.kafka_bootstrap, keyring, logs, quick, load.streams,
                                   load.rate, load.trees, load.pairs)
        else:
            figures = bench.run(common.kafka_bootstrap, keyring, logs, quick, load.streams,
                                load.rate)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.table(figures)
    _save(out, "worker" if not load.trees else "worker-pair",
          "One worker at a GPU's rate: its CPU per token", figures, table,
          f"One SIMULATED worker and the broker alone on {figures['machine']}: prompts of "
          "conversations of their own, sealed with keys the bench wrote to chat.keys, "
          f"written straight to chat.prompts, open loop, {load.streams} turns running at "
          f"{load.rate:g} tokens/s each, {4 * load.rate:.0f} tokens a turn; no reader of "
          "chat.live. CPU is each process's user + system time from /proc over the "
          "measured window, per token the worker generated in it (the SIMULATED engine's "
          "own work included, as vLLM's output processing would be)."
          + (" Side A ran {A}, side B {B}; each pair's ratio is B / A.".format(
              **figures["trees"]) if load.trees else "")
          + f" Measured with `pipeline bench worker{' --quick' if quick else ''}"
          f"{load.flags()}`.")
    return table


def fairness(common: CommonSettings, quick: bool, out: Path) -> str:
    from bench import fairness as bench

    figures = bench.run(common.kafka_bootstrap, common.state_dir / "bench-logs", quick)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.table(figures)
    _save(out, "fairness", "How a worker shares its engine between tenants", figures, table,
          f"SIMULATED worker, {figures['slots']} slots, {figures['tokens_per_s']} tokens/s "
          "per turn, prompts written straight to chat.prompts. Beta's first token: from "
          "its prompt's write to its GenerationStarted, 5 turns of 16 tokens, alone on "
          f"an idle worker, then once alpha's {figures['backlog']} turns of "
          f"{figures['long_tokens']:,} hold every slot (≥: none within "
          f"{figures['window_s']:.0f} s). Two backlogs: alpha's {figures['both']} turns of "
          "32 tokens, then beta's as many; tokens served while both had turns waiting, "
          "Jain's index over them (1: equal), and both tenants' tokens/s together. One "
          f"tenant: alpha's {figures['one_tenant_turns']} turns of 64 alone, tokens/s from "
          "the first start to the last end. Each side's worker is new, serving a model "
          f"of its own. On {figures['machine']}. Measured with `pipeline bench fairness"
          f"{' --quick' if quick else ''}`.")
    return table


def projection(common: CommonSettings, quick: bool, out: Path) -> str:
    from bench.projection import run

    return run(common.kafka_bootstrap, common.database_url, 2_000 if quick else 10_000, 16,
               common.partitions, out)


def analytics(common: CommonSettings, quick: bool, out: Path) -> str:
    from bench.analytics import run

    return run(common.kafka_bootstrap, common.database_url, common.partitions, quick, out,
               common.state_dir / "bench-logs")


# The benches that run in this process alone (``bench.<part>``: its ``run(quick)`` and
# ``table``): each one's title, and its notes from its figures.
IN_PROCESS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "sealing": ("What sealing content costs in CPU per token", lambda figures: (
        "In process, keys in memory (pipeline.sealing, AES-256-GCM from cryptography): "
        "each case's whole write and read path (the worker's live record made and "
        "encoded, then decoded by a reader; a turn's end encoded and decoded), sealed "
        f"and in the clear, alternating, medians of {figures['rounds']} rounds.")),
    "hotpath": ("The worker's CPU per token on its own path", lambda figures: (
        "In process, no Kafka and no engine (bench/hotpath.py): each running turn takes "
        "one output per engine step, and each step's live records are made, sealed (a "
        "key per conversation) and dropped. Process CPU per token, median of "
        f"{figures['rounds']} rounds.")),
    "frontend": ("vLLM's front end: its CPU per token, detokenising and not, in the "
                 "worker's process and apart", lambda figures: (
        "In process, no Kafka (bench/frontend.py): one VllmEngine, the tiny model with "
        f"random weights on this CPU, {figures['clients']} closed-loop clients of "
        f"{figures['tokens']} tokens a reply (ignore_eos). Rounds alternate on the same "
        "engine with and without detokenising (SamplingParams.detokenize); each is this "
        "process's CPU per token (vLLM's output processing, the worker's pump and sinks, "
        "and the clients; not vLLM's engine core, a process of its own). Medians of "
        f"{figures['pairs']} pairs; the ratio is the median of each pair's. The second "
        "table alternates the same load between that engine and a VllmProcess (vLLM's "
        "front end in a child process, what a worker runs by default), both detokenising: "
        "this process's CPU per token either way, the child's, and both processes' "
        "together over the one's (the median of each pair's). Both processes run on "
        "uvloop, as a worker does.")),
}


def _in_process(part: str, quick: bool, out: Path, clients: list[int] | None = None) -> str:
    """``clients``: frontend's load, its largest level (default: the bench's own)."""
    import importlib

    bench = importlib.import_module(f"bench.{part}")
    title, notes = IN_PROCESS[part]
    load = {"clients": max(clients)} if part == "frontend" and clients else {}
    figures = bench.run(quick, **load)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table: str = bench.table(figures)
    flags = "".join(f" --{name} {value}" for name, value in load.items())
    _save(out, part, title, figures, table, f"{notes(figures)} On {figures['machine']}. "
          f"Measured with `pipeline bench {part}{' --quick' if quick else ''}{flags}`.")
    return table


def memory(common: CommonSettings, quick: bool, out: Path) -> str:
    from bench import memory as bench

    figures = bench.run(common.kafka_bootstrap, common.state_dir / "bench-logs", quick)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.table(figures)
    _save(out, "memory", "What long-term memory adds to a turn's time to first token",
          figures, table,
          "A vLLM worker and the memory service, both with the tiny random model on CPU "
          f"(embeddings of 256 dimensions; memories in PostgreSQL with pgvector), on "
          f"{figures['machine']}. One client, one turn at a time, the same question with "
          f"memory on and off alternating, {figures['rounds']} pairs. Measured with "
          f"`pipeline bench memory{' --quick' if quick else ''}`.")
    return table


def scale(common: CommonSettings, quick: bool, out: Path, conversations: int,
          erasures: int = 0) -> str:
    from bench import scale as bench

    if quick:
        conversations = min(conversations, 20_000)
    figures = bench.run(conversations, common.state_dir / "bench-scale",
                        common.state_dir / "bench-logs", rounds=30 if quick else 100,
                        erasures=erasures)
    figures |= {"measured_at": _now(), "machine": _machine(), "quick": quick}
    table = bench.table(figures)
    erased = f" and {erasures:,} erasures" if erasures else ""
    _save(out, "scale", f"A year of state: {conversations:,} conversations{erased}", figures,
          table,
          f"A broker and a PostgreSQL of the bench's own (replication 1, "
          f"{figures['partitions']} partitions), on {figures['machine']}: the bench, the "
          "broker, PostgreSQL and the services share these cores. Empty log first, then "
          "the same measures with the history written through the project's writers "
          "(`bench/history.py`: per conversation its data key, a titled session, a turn's "
          "prompt, start, end and live record, all sealed) and caught up by the projector. "
          "Start-up: from the process's start to its ready line (the gateway: /health "
          "answering; a command: its exit), RSS of its process tree then (a command's "
          "peak). Requests: a gateway, a SIMULATED worker and the projector running, "
          "one client, one request at a time, except beside the resumes. Measured with "
          f"`pipeline bench scale{' --quick' if quick else ''}"
          f"{f' --conversations {conversations}' if conversations != 1_000_000 else ''}"
          f"{f' --erasures {erasures}' if erasures else ''}`.")
    return table


def pair(common: CommonSettings, out: Path, label: str, sides: tuple[Any, Any], *,
         rate: float, pairs: int, rounds: int, streams: int) -> str:
    from bench import pair as bench

    figures = bench.run(common.kafka_bootstrap, common.state_dir / "bench-logs", *sides,
                        rate=rate, pairs=pairs, rounds=rounds, streams=streams)
    figures |= {"measured_at": _now(), "machine": _machine(), "label": label}
    report = bench.report(figures)
    _save(out, f"pair-{label}", f"A change's effect, in pairs: {label}", figures, report,
          f"On {figures['machine']}. Each figure is a process's user + system CPU from "
          "/proc over the measured window, per token the clients received; the load "
          "generator's ratio shows the host's drift. Measured with `pipeline bench pair`.")
    return report


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def run(common: CommonSettings, parts: list[str], quick: bool, out: Path,
        resolve_model: Callable[[CommonSettings, WorkerSettings], tuple[Path, str]],
        before: Path | None = None, conversations: int = 1_000_000,
        shape: ServingShape | None = None, load: WorkerLoad | None = None,
        erasures: int = 0) -> None:
    started = time.monotonic()
    for part in parts:
        print(f"\n== {part} ==", flush=True)
        part_started = time.monotonic()
        if part == "serving":
            table = serving(common, quick, out, resolve_model, shape)
        elif part == "capacity":
            table = capacity(common, quick, out)
        elif part == "log":
            table = log(common, quick, out, before)
        elif part == "fairness":
            table = fairness(common, quick, out)
        elif part == "projection":
            table = projection(common, quick, out)
        elif part in IN_PROCESS:
            table = _in_process(part, quick, out, shape.clients if shape else None)
        elif part == "memory":
            table = memory(common, quick, out)
        elif part == "worker":
            table = worker(common, quick, out, load or WorkerLoad())
        elif part == "scale":
            table = scale(common, quick, out, conversations, erasures)
        else:
            table = analytics(common, quick, out)
        print(f"{table}\n\n({part}: {time.monotonic() - part_started:.0f} s)", flush=True)
    print(f"\nbench finished in {time.monotonic() - started:.0f} s; figures in {out}/")
