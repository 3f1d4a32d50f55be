"""``pipeline bench scale``: what a year of state costs. A stack of its own (broker and
PostgreSQL under ``.state/bench-scale``) is measured empty, then filled with N finished
conversations through the project's writers (``bench.history``), caught up by the
projector (the replay rate), and measured again in the same run:

* each component's start-up (to its ready line, or its answer for a command) and RSS
  (its process tree, when ready; a command's peak): gateway, worker (SIMULATED engine),
  projector, memory service, analytics, ``pipeline erase``, ``pipeline audit``;
* with a gateway, a worker and the projector running: a new turn's time to first token,
  a resume at a position of a recent turn (at its start, its middle, its end, and at the
  start of its partition), a session read, a session deleted, p50 and p99; and a
  session read of another tenant while resumes from partitions' starts run beside it.

``--erasures N`` writes N erasures with the history (a bulk ``pipeline erase``'s), which
every process reads at its start and holds for two erasure windows.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
from tqdm import tqdm

from bench.history import Written, build
from infra.kafka_broker import KafkaBroker
from infra.postgres import PostgresServer
from infra.process import free_port
from pipeline.erasures import erasure_record
from pipeline.kafka import (
    GroupConsumer,
    GroupStatus,
    ProduceError,
    ensure_topics,
    wait_for_broker,
)
from pipeline.kafka.plain import PlainWriter
from pipeline.settings import REPO_ROOT
from pipeline.topics import (
    CONVERSATION_TOPICS,
    ERASURES,
    STORE_TOPICS,
    TopicPolicy,
    topic_specs,
    workers_group,
)
from projections.migrate import migrate

PARTITIONS = 6
SERVICES = ("gateway", "worker", "projector", "memory", "analytics")
# What says a service is ready: a line of its log.
READY = {"worker": "worker ready", "projector": "projector ready", "memory": "memory ready",
         "analytics": "Ready"}


class Stack:
    """A broker and a PostgreSQL of the bench's own, and the services it starts on them."""

    def __init__(self, home: Path, logs: Path) -> None:
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        self.home, self.logs = home, logs
        logs.mkdir(parents=True, exist_ok=True)
        self.broker = KafkaBroker(home=home / "kafka", libs=REPO_ROOT / ".state" / "kafka-libs",
                                  port=free_port(), controller_port=free_port(), heap="1g")
        self.postgres = PostgresServer(home=home / "postgres", port=free_port(),
                                       database="scale")
        self.kek = base64.b64encode(os.urandom(32)).decode()

    def start(self) -> None:
        self.broker.start()
        self.postgres.start()
        wait_for_broker(self.broker.bootstrap)
        ensure_topics(self.broker.bootstrap, topic_specs(TopicPolicy(PARTITIONS), 1))
        migrate(self.postgres.url)

    def stop(self) -> None:
        self.postgres.stop()
        self.broker.stop()

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": self.broker.bootstrap,
                "DATABASE_URL": self.postgres.url, "PIPELINE_PARTITIONS": str(PARTITIONS),
                "PIPELINE_KEK": self.kek, "PIPELINE_LOG_LEVEL": "INFO",
                "PIPELINE_STATE_DIR": str(REPO_ROOT / ".state"), **extra}

    def spawn(self, name: str, *args: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.logs / f"scale-{name}-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "launch", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env(**env),
                                    start_new_session=True)
        return proc, log


def _tree_rss_mb(pid: int) -> float:
    """The RSS of a process and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _ready(stack: Stack, name: str, port: int, timeout: float = 300.0
           ) -> tuple[subprocess.Popen[bytes], float, float]:
    """Start a service; its start-up (s) and RSS (MB) once ready."""
    args = {"gateway": ["gateway", "--port", str(port)],
            "worker": ["worker", "--engine", "sim", "--metrics-port", str(port)],
            "projector": ["projector", "--metrics-port", str(port)],
            "memory": ["memory", "--port", str(port)],
            "analytics": ["analytics", "--metrics-port", str(port)]}[name]
    env = {"GATEWAY_MODELS": "sim"} if name == "gateway" else {}
    started = time.monotonic()
    proc, log = stack.spawn(name, *args, **env)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: see {log}")
        if name == "gateway":
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        elif READY[name] in log.read_text(errors="replace"):
            break
        if time.monotonic() - started > timeout:
            _stop(proc)
            raise TimeoutError(f"{name} not ready in {timeout:.0f} s: see {log}")
        time.sleep(0.02)
    return proc, time.monotonic() - started, _tree_rss_mb(proc.pid)


def _command(stack: Stack, *args: str) -> tuple[float, float, int]:
    """Run a ``pipeline`` command: its wall time (s), peak RSS (MB) and exit status."""
    started = time.monotonic()
    proc, log = stack.spawn(args[0], *args)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(log.read_text(errors="replace")[-2000:], file=sys.stderr)
    return time.monotonic() - started, usage.ru_maxrss / 1024, proc.returncode


def startups(stack: Stack) -> dict[str, dict[str, float]]:
    """Each service started alone."""
    out: dict[str, dict[str, float]] = {}
    for name in SERVICES:
        proc, seconds, rss = _ready(stack, name, free_port())
        _stop(proc)
        out[name] = {"start_s": seconds, "rss_mb": rss}
        print(f"  {name}: ready in {seconds:.2f} s, {rss:.0f} MB", flush=True)
    return out


def commands(stack: Stack, audited: uuid.UUID, erased: uuid.UUID) -> dict[str, dict[str, float]]:
    out = {}
    for name, args in (("audit", ("audit", str(audited), "--json")),
                       ("erase", ("erase", "--conversation", str(erased)))):
        seconds, rss, status = _command(stack, *args)
        if status != 0:
            raise RuntimeError(f"pipeline {' '.join(args)} exited with {status}")
        out[name] = {"start_s": seconds, "rss_mb": rss}
        print(f"  {name}: done in {seconds:.2f} s, peak {rss:.0f} MB", flush=True)
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(ordered), "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def _first_token_s(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                   ) -> tuple[float, list[str], str]:
    """A streamed turn: seconds to its first content chunk, its event ids, its id."""
    started = time.monotonic()
    first = None
    ids: list[str] = []
    completion = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      headers=headers or {}, timeout=60) as r:
        if r.status_code != 200:
            raise RuntimeError(f"a turn was refused: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            completion = chunk["id"]
            ids.append(chunk["event_id"])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get(
                    "content"):
                first = time.monotonic() - started
    if first is None:
        raise RuntimeError("a turn streamed no content")
    return first, ids, completion


def _resume_s(url: str, completion: str, last_event_id: str) -> float:
    started = time.monotonic()
    with httpx.stream("GET", f"{url}/v1/chat/completions/{completion}/stream",
                      headers={"Last-Event-ID": last_event_id}, timeout=60) as r:
        if r.status_code not in (200, 400):
            raise RuntimeError(f"a resume answered {r.status_code}")
        for _ in r.iter_bytes():
            pass
    return time.monotonic() - started


def latencies(url: str, old: list[Written], rounds: int) -> dict[str, Any]:
    """With a gateway, a worker and the projector running on the stack."""
    body = {"model": "sim", "max_tokens": 16,
            "messages": [{"role": "user", "content": "a new question"}]}
    _first_token_s(url, body)  # warm
    ttft, turns = [], []
    for _ in range(rounds):
        first, ids, completion = _first_token_s(url, body)
        ttft.append(first)
        turns.append((completion, ids))
    resumes = []
    for completion, ids in turns:
        partition = ids[0].split("-")[0]
        for at in (ids[0], ids[len(ids) // 2], ids[-1], f"{partition}-0-0"):
            resumes.append(_resume_s(url, completion, at))
    reads: list[float] = []
    readable = [w.conversation_id for w in old] or [
        uuid.UUID(c[len("chatcmpl-"):len("chatcmpl-") + 32]) for c, _ in turns]
    for conversation in random.sample(readable, min(len(readable), rounds)):
        started = time.monotonic()
        r = httpx.get(f"{url}/v1/sessions/{conversation}/messages", timeout=30)
        reads.append(time.monotonic() - started)
        if r.status_code != 200:
            raise RuntimeError(f"a session read answered {r.status_code}: {r.text}")
    beside = _reads_beside_resumes(url, turns, rounds)
    deletes = []
    for completion, _ in turns[: rounds // 2]:
        deleted = uuid.UUID(completion[len("chatcmpl-"):len("chatcmpl-") + 32])
        started = time.monotonic()
        r = httpx.delete(f"{url}/v1/sessions/{deleted}", timeout=30)
        deletes.append(time.monotonic() - started)
        if r.status_code != 200:
            raise RuntimeError(f"a deletion answered {r.status_code}: {r.text}")
    return {"new_turn_ttft": _percentiles(ttft), "resume": _percentiles(resumes),
            "session_read": _percentiles(reads), "delete": _percentiles(deletes),
            "session_read_beside_resumes": _percentiles(beside)}


def _reads_beside_resumes(url: str, turns: list[tuple[str, list[str]]], rounds: int
                          ) -> list[float]:
    """Session reads while four clients resume turns from their partitions' starts."""
    stop = time.monotonic() + 3600
    done = False

    def storm() -> int:
        n = 0
        while not done and time.monotonic() < stop:
            completion, ids = random.choice(turns)
            _resume_s(url, completion, f"{ids[0].split('-')[0]}-0-0")
            n += 1
        return n

    with ThreadPoolExecutor(4) as pool:
        storms = [pool.submit(storm) for _ in range(4)]
        time.sleep(0.5)
        reads = []
        for completion, _ in turns[:rounds]:
            conversation = uuid.UUID(completion[len("chatcmpl-"):len("chatcmpl-") + 32])
            started = time.monotonic()
            httpx.get(f"{url}/v1/sessions/{conversation}", timeout=30)
            reads.append(time.monotonic() - started)
        done = True
        for s in storms:
            s.result()
    return reads


def _running(stack: Stack) -> tuple[str, list[subprocess.Popen[bytes]]]:
    port = free_port()
    procs = [_ready(stack, name, port if name == "gateway" else free_port())[0]
             for name in ("projector", "worker", "gateway")]
    return f"http://127.0.0.1:{port}", procs


def _settled(stack: Stack, groups: list[str]) -> None:
    """Let these groups start at the log's end, as though they had read the history."""
    bootstrap = stack.broker.bootstrap
    for group in groups:
        consumer = GroupConsumer(bootstrap, group, "bench")
        try:
            ends = {(t, p): consumer.watermarks_sync(t, p)[1]
                    for t in CONVERSATION_TOPICS for p in range(PARTITIONS)}
            consumer.commit_sync(ends)
        finally:
            asyncio.run(consumer.close())


def _projected(stack: Stack, records: int) -> tuple[float, float]:
    """Start the projector and wait until it has caught up: its rate (records/s), and
    its largest RSS meanwhile (MB)."""
    status = GroupStatus(stack.broker.bootstrap, "projector")
    proc, _, _ = _ready(stack, "projector", free_port())
    started = time.monotonic()
    peak = 0.0
    bar = tqdm(total=records, unit="rec", desc="projector catching up")
    try:
        while True:
            with psycopg.connect(stack.postgres.url) as conn:
                done = conn.execute("SELECT coalesce(sum(next_offset), 0)"
                                    " FROM projector_positions").fetchone()
            at = int(done[0]) if done else 0
            bar.update(at - bar.n)
            ends = sum(end for t in STORE_TOPICS
                       for _, end in status.per_partition(t).values())
            if at >= ends:
                break
            if proc.poll() is not None:
                raise RuntimeError("the projector exited while catching up")
            peak = max(peak, _tree_rss_mb(proc.pid))
            time.sleep(2)
    finally:
        bar.close()
        status.close()
        _stop(proc)
    return records / (time.monotonic() - started), peak


def run(conversations: int, home: Path, logs: Path, rounds: int = 100,
        erasures: int = 0) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    stack = Stack(home, logs)
    stack.start()
    figures: dict[str, Any] = {"conversations": conversations, "partitions": PARTITIONS,
                               "erasures": erasures}
    try:
        print("== the empty log ==", flush=True)
        figures["empty"] = _phase(stack, [], rounds)
        print(f"== writing {conversations:,} conversations ==", flush=True)
        bar = tqdm(total=conversations, unit="conv", desc="history")
        started = time.monotonic()
        sample = build(stack.broker.bootstrap, base64.b64decode(stack.kek), conversations,
                       PARTITIONS, progress=lambda n: bar.update(n - bar.n))
        bar.close()
        figures["build_s"] = time.monotonic() - started
        if erasures:
            print(f"== writing {erasures:,} erasures ==", flush=True)
            started = time.monotonic()
            _erase(stack.broker.bootstrap, erasures)
            figures["erasures_s"] = time.monotonic() - started
        _settled(stack, [workers_group("sim"), "memory", "analytics"])
        records = sum(GroupStatus(stack.broker.bootstrap, "projector").per_partition(t)[p][1]
                      for t in STORE_TOPICS for p in range(PARTITIONS))
        print(f"== the projector reads {records:,} records ==", flush=True)
        figures["replay_records_per_s"], figures["projector_peak_rss_mb"] = _projected(
            stack, records)
        figures["log_bytes"] = _log_bytes(stack.broker.home)
        print("== the full log ==", flush=True)
        figures["full"] = _phase(stack, sample, rounds)
        return figures
    except BaseException:
        partial = logs / "scale-partial.json"
        partial.write_text(json.dumps(figures, indent=2, default=str))
        print(f"the bench stopped; what it measured is in {partial}", file=sys.stderr)
        raise
    finally:
        stack.stop()


def _erase(bootstrap: str, count: int) -> None:
    """``count`` erasures of conversations that never were, written now (within every
    process's horizon), as an operator's bulk ``pipeline erase`` writes them."""
    writer = PlainWriter(bootstrap, "bench-erasures", linger_ms=50, compression="lz4")
    with tqdm(total=count, unit="erasure", desc="erasures") as bar:
        for n in range(count):
            while True:
                try:
                    writer.send(ERASURES, *erasure_record(uuid.uuid4(), "bench", "erase"))
                    break
                except ProduceError:  # the client's queue is full: let it send
                    writer.poll(0.1)
            if n % 10_000 == 0:
                bar.update(n - bar.n)
        bar.update(count - bar.n)
    failed = writer.flush(120)
    if failed:
        raise RuntimeError(f"erasures not written: {failed[:3]}")


def _phase(stack: Stack, old: list[Written], rounds: int) -> dict[str, Any]:
    """Each service started alone; then, with a gateway, a worker and the projector
    running, the requests, and the commands on a session of the moment (and on one from
    the history's start, if there is a history)."""
    figures: dict[str, Any] = {"startup": startups(stack)}
    url, procs = _running(stack)
    try:
        figures["latency"] = latencies(url, old, rounds)
        for name, got in figures["latency"].items():
            print(f"  {name}: p50 {got['p50_ms']:.1f} ms, p99 {got['p99_ms']:.1f} ms",
                  flush=True)
        now = [uuid.UUID(httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": what}]
        }).headers["x-session-id"]) for what in ("audit me", "erase me")]
        time.sleep(2)  # projected
        figures["startup"] |= commands(stack, now[0], now[1])
        if old:
            seconds, rss, status = _command(stack, "audit", str(old[0].conversation_id),
                                            "--json")
            if status != 0:
                raise RuntimeError(f"the audit of {old[0].conversation_id} failed")
            figures["audit_old"] = {"start_s": seconds, "rss_mb": rss}
            print(f"  audit of a session from the history's start: {seconds:.2f} s, "
                  f"peak {rss:.0f} MB", flush=True)
    finally:
        for proc in procs:
            _stop(proc)
    return figures


def _log_bytes(kafka_home: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in kafka_home.rglob("*.log"):
        topic = path.parent.name.rsplit("-", 1)[0]
        if topic.startswith("chat."):
            sizes[topic] = sizes.get(topic, 0) + path.stat().st_size
    return sizes


def table(figures: dict[str, Any]) -> str:
    empty, full = figures["empty"], figures["full"]
    rows = ["| component | start-up, empty log | with the history | RSS, empty | with "
            "the history |", "|---|---|---|---|---|"]
    for name in (*SERVICES, "erase", "audit"):
        e, f = empty["startup"][name], full["startup"][name]
        rows.append(f"| {name} | {e['start_s']:.2f} s | {f['start_s']:.2f} s | "
                    f"{e['rss_mb']:.0f} MB | {f['rss_mb']:.0f} MB |")
    rows += ["", "| request | empty log p50 / p99 | with the history p50 / p99 |",
             "|---|---|---|"]
    names = {"new_turn_ttft": "a new turn's first token", "resume": "a resume (start, "
             "middle, end of a turn; a partition's start)", "session_read": "a session "
             "read", "session_read_beside_resumes": "a session read beside 4 clients "
             "resuming from partitions' starts", "delete": "a session deleted"}
    for key, label in names.items():
        e, f = empty["latency"][key], full["latency"][key]
        rows.append(f"| {label} | {e['p50_ms']:.1f} / {e['p99_ms']:.1f} ms | "
                    f"{f['p50_ms']:.1f} / {f['p99_ms']:.1f} ms |")
    logged = ", ".join(f"{t} {b / 2**20:,.1f} MiB" for t, b in sorted(
        figures["log_bytes"].items()) if b)
    if "audit_old" in full:
        rows.append(f"\nAn audit of a session from the history's start reads its partitions "
                    f"from then on: {full['audit_old']['start_s']:.2f} s, peak "
                    f"{full['audit_old']['rss_mb']:.0f} MB (here the whole history was "
                    "written within a minute, so that is every record of its partitions).")
    erased = (f", and {figures['erasures']:,} erasures in {figures['erasures_s']:.0f} s "
              "(every process reads them at its start, and holds them)"
              if figures.get("erasures") else "")
    rows += ["", f"History: {figures['conversations']:,} conversations written in "
             f"{figures['build_s']:.0f} s{erased}; the projector read the log at "
             f"{figures['replay_records_per_s']:,.0f} records/s (its RSS at most "
             f"{figures['projector_peak_rss_mb']:.0f} MB meanwhile). The log: {logged}."]
    return "\n".join(rows)

