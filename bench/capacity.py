"""``pipeline bench capacity``: what the pipeline itself sustains, with the SIMULATED engine
(no model), so that the engine is never the bottleneck. Each part starts a simulated
worker, a projector and one gateway as processes on the local stack:

* **delta latency**: 256 concurrent streams, at several token rates per stream; for
  every token delta a client receives, the time from the worker creating it (the
  event's ``occurred_at``, read back from the log at the SSE id's position) to the
  client receiving it; same clock. With the machine's CPU use, to show where it
  saturates. One point at 256 x 20 runs first, unrecorded, to warm the broker's JIT.
* **gateway throughput**: streams fast enough to saturate the machine; the tokens/s
  one gateway process, then two on one port (``pipeline gateway --workers 2``), deliver
  to their clients, and their CPU share.
* **open streams**: many slow streams held open at once; the gateway's resident
  memory per stream.

Every figure comes with the load generator's and the gateway's CPU shares.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from bench.loadgen import Request, chat_body, closed_loop, http_client, percentile, stream_once
from bench.stack import in_tree, wait_projected
from infra.process import free_port, wait_http
from pipeline.codec import parse, parse_live
from pipeline.kafka import LogReader
from pipeline.topics import GENERATIONS, LIVE
from schemas import TokenDelta
from schemas.live import entries
from workers.sim_engine import SIM_CLOCK, sim_token_text

_TICKS = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


# What the per-component CPU table covers, in its order. "bench probe" is the side
# process measuring the Kafka hop; "load generator" is this process (the SSE clients).
COMPONENTS = ("kafka broker", "postgresql", "worker", "gateway", "projector", "bench probe")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        out[int(entry.name)] = (int(stat[1]), cmd)
    return out


def _component_pids(roots: dict[str, int]) -> dict[str, set[int]]:
    """Each component's processes: the stack's own (with their children) by the pids the
    bench started, the broker's JVM and PostgreSQL's processes by their command lines."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> set[int]:
        found, todo = set(), [pid]
        while todo:
            p = todo.pop()
            if p in procs and p not in found:
                found.add(p)
                todo.extend(children.get(p, []))
        return found

    out = {name: tree(pid) for name, pid in roots.items()}
    out["kafka broker"] = {p for p, (_, cmd) in procs.items()
                           if "java" in cmd and "kafka" in cmd.lower()}
    out["postgresql"] = {p for p, (_, cmd) in procs.items()
                         if cmd.split(" ", 1)[0].endswith("postgres")
                         or cmd.startswith("postgres:")}
    return out


def _cpu_snapshot(roots: dict[str, int]) -> dict[str, dict[int, float]]:
    snapshot: dict[str, dict[int, float]] = {}
    for name, pids in _component_pids(roots).items():
        snapshot[name] = {}
        for pid in pids:
            with contextlib.suppress(OSError):
                snapshot[name][pid] = _cpu_s(pid)
    return snapshot


def _cpu_used(before: dict[str, dict[int, float]],
              after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds each component used between the snapshots (a process that started in
    between counts whole; one that ended in between is lost, as /proc forgets it)."""
    return {name: sum(cpu - before.get(name, {}).get(pid, 0.0)
                      for pid, cpu in after.get(name, {}).items())
            for name in after}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def _stack(bootstrap: str, log_dir: Path, env: dict[str, str], *, max_num_seqs: int = 8192,
           gateways: int = 1, tree: Path | None = None, python: Path | None = None
           ) -> Iterator[tuple[str, dict[str, int], str]]:
    """A simulated worker, a projector and a gateway (``gateways`` processes on its port,
    ``pipeline gateway --workers``); yields the URL, their pids and the worker's metrics
    URL, once the projector has
    caught up with whatever earlier runs left in the log. ``env``: settings added to the
    three's environment; ``tree``: a checkout whose code they run (this one's by default),
    for comparing two versions of the code; ``python``: the interpreter they run (this
    process's by default)."""
    port = free_port()
    exe = [str(python or sys.executable), "-m", "launch"]
    # One tenant's load: no tenant's cap applies (the capacity is what is measured).
    env = {**os.environ, "GATEWAY_MODELS": "sim", "GATEWAY_MAX_BACKLOG": "1000000",
           "GATEWAY_MAX_WAITING_PER_TENANT": "1000000",
           "GATEWAY_MAX_STREAMS_PER_TENANT": "1000000",
           "GATEWAY_CANCEL_GRACE_S": "0", "WORKER_SERVED_MODEL_NAME": "sim", **env}
    in_tree(env, tree)
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_metrics = free_port()
    procs = []
    for label, cmd in (
            ("projector", ["projector"]),
            ("worker", ["worker", "--engine", "sim", "--max-num-seqs", str(max_num_seqs),
                        "--metrics-port", str(worker_metrics)]),
            ("gateway", ["gateway", "--port", str(port), "--workers", str(gateways)])):
        with open(log_dir / f"capacity-{label}.log", "wb") as log:
            procs.append(subprocess.Popen([*exe, *cmd], stdout=log, stderr=subprocess.STDOUT,
                                          env=env, cwd=tree, start_new_session=True))
    try:
        wait_http(f"http://127.0.0.1:{port}/health", procs, timeout=120,
                  logs=f"the stack's logs, {log_dir}/capacity-*.log")
        wait_projected(bootstrap)
        yield (f"http://127.0.0.1:{port}", {"projector": procs[0].pid, "worker": procs[1].pid,
                                            "gateway": procs[2].pid},
               f"http://127.0.0.1:{worker_metrics}/metrics")
        # Turns whose clients left (the held streams) are stopped by the worker: stopped
        # before it is, they would be left open in the log for the next run's worker to
        # read back to and end.
        _wait_idle(f"http://127.0.0.1:{worker_metrics}/metrics")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:  # never left running into the next part
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _sample(metrics: str, name: str) -> float:
    """An unlabelled sample's value in Prometheus text (0 if absent)."""
    return next((float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith(f"{name} ")), 0.0)


def _scrape(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        return _sample(resp.read().decode(), name)


def _wait_idle(metrics_url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = _scrape(metrics_url, "worker_running_sequences")
        if not running:
            return
        time.sleep(0.5)
    print(f"the worker still ran {running:.0f} turns after {timeout:.0f} s; left to the next run",
          file=sys.stderr)


def _event_times(bootstrap: str, ids: list[str]) -> dict[str, float]:
    """SSE id -> the wall time its delta was written, read back from the log: the live
    record's ``at`` for an id ``partition-offset-index`` (ms: the record is sealed at the
    end of the engine step that made its deltas), the ``TokenDelta``'s ``occurred_at``
    for an id ``partition-offset`` (the code before the live stream, for pairs)."""
    wanted: dict[tuple[str, int], set[int]] = {}
    for event_id in ids:
        parts = event_id.split("-")
        topic = LIVE if len(parts) == 3 else GENERATIONS
        wanted.setdefault((topic, int(parts[0])), set()).add(int(parts[1]))
    reader = LogReader(bootstrap, "bench-capacity-reader", "bench")
    times = {}
    try:
        for (topic, p), offsets in wanted.items():
            for record in reader.read_range_sync(topic, p, min(offsets), max(offsets) + 1,
                                                 timeout=120):
                at = record.position.offset
                if at not in offsets:
                    continue
                if topic == LIVE:
                    batch = parse_live(record.value)  # times only
                    for entry, _, _ in entries(batch):
                        times[f"{p}-{at}-{entry}"] = batch.at / 1000
                else:
                    event = parse(record.value)
                    if isinstance(event, TokenDelta):
                        times[f"{p}-{at}"] = event.occurred_at.timestamp()
    finally:
        asyncio.run(reader.close())
    return times


def _kafka_hop(bootstrap: str, seconds: float) -> list[float]:
    """For ``seconds``: each new delta's delay from its writing in the worker to a plain
    consumer in a process of its own (the Kafka hop alone, no gateway), in ms: each
    delta of a live record, or each ``TokenDelta`` (the code before the live stream)."""
    # Assigned once, at the start: a long poll, which returns as soon as a transaction
    # commits. (With 10 ms, ``QUICK_ASSIGN``, the probe's empty fetches were 9% of the
    # broker's requests in a run of the point, charged to the plumbing's broker.)
    consumer = LogReader(bootstrap, "bench-kafka-hop", "bench", **{"fetch.wait.max.ms": 500})
    try:
        consumer.follow_from_end_sync(LIVE)
        consumer.follow_from_end_sync(GENERATIONS)
        # Each batch is kept with the time its poll returned and decoded once the window is
        # over, so that the probe's own CPU in the window is its Kafka client's alone.
        batches = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if records := consumer.poll_batch_sync(1000, 0.05):
                batches.append((time.time(), records))
    finally:
        asyncio.run(consumer.close())
    delays = []
    for now, records in batches:
        for record in records:
            event = json.loads(record.value or b"{}")
            if event.get("type") == "LiveBatch":
                delays += [(now - event["at"] / 1000) * 1000] * len(event.get("deltas", ()))
            elif event.get("type") == "TokenDelta":
                created = datetime.fromisoformat(event["occurred_at"]).timestamp()
                delays.append((now - created) * 1000)
    return delays


async def _load(url: str, streams: int, rounds: int, max_tokens: int, keep_ids: bool,
                stagger_s: float = 0.0, measured: Callable[[bool], None] | None = None,
                ) -> tuple[list[Request], float, float]:
    """Closed-loop streams; the requests, the wall seconds and the client's CPU share.
    ``measured(True)`` and ``measured(False)`` are called as the measured part (after the
    warm-up) starts and ends."""
    done: list[Request] = []
    async with http_client(streams + 8) as client:
        async def one(seed: int) -> Request:
            request = await stream_once(client, url, chat_body("sim", "go", max_tokens, seed),
                                        keep_ids)
            done.append(request)
            return request

        await closed_loop(one, 4, 1)  # warm-up
        done.clear()
        if measured:
            measured(True)
        summary = await closed_loop(one, streams, rounds, stagger_s)
        if measured:
            measured(False)
    return done, summary.seconds, summary.client_cpu


def delta_latency(bootstrap: str, log_dir: Path, streams: int, rounds: int,
                  tokens_per_s: float, tree: Path | None = None,
                  env: dict[str, str] | None = None, python: Path | None = None
                  ) -> dict[str, Any]:
    """``streams`` streams of about 4 s each, staggered over one stream's length; the
    stack runs ``tree``'s code with ``env`` added to its environment (see ``_stack``)."""
    max_tokens = max(20, round(tokens_per_s * 4))
    stream_s = max_tokens / tokens_per_s
    spawn = multiprocessing.get_context("spawn")
    with _stack(bootstrap, log_dir, {**(env or {}), "WORKER_SIM_TOKENS_PER_S": str(tokens_per_s)},
                tree=tree, python=python) as (url, pids, worker_metrics), \
            concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as side:
        probe = side.submit(os.getpid).result()  # started before the load
        roots = {**pids, "bench probe": probe}
        snapshots: dict[bool, tuple[dict[str, dict[int, float]], tuple[int, int]]] = {}
        # The worker's and the gateway's Kafka transactions: each has a fixed cost on the
        # broker. Counted at the window's start and end.
        counters = {"transactions_per_s": (worker_metrics, "worker_transactions"),
                    "live_records_per_s": (worker_metrics, "worker_live_records"),
                    "gateway_transactions_per_s": (f"{url}/metrics",
                                                   "gateway_prompt_transactions")}
        transactions: dict[bool, dict[str, float]] = {}

        def measured(starting: bool) -> None:  # the window every CPU figure covers
            snapshots[starting] = _cpu_snapshot(roots), _machine_busy()
            transactions[starting] = {name: _scrape(*where) for name, where in counters.items()}

        hop = side.submit(_kafka_hop, bootstrap, stream_s * (rounds + 2))
        requests, seconds, client_cpu = asyncio.run(
            _load(url, streams, rounds, max_tokens, True, stagger_s=stream_s,
                  measured=measured))
        (cpu, busy), (cpu_after, busy_after) = snapshots[True], snapshots[False]
        used = _cpu_used(cpu, cpu_after)
        gateway_cpu = used["gateway"] / seconds
        hop_ms = hop.result()
    machine = (busy_after[0] - busy[0]) / max(busy_after[1] - busy[1], 1)
    offset = time.time() - time.perf_counter()
    arrivals = [(i, t + offset) for r in requests for i, t in r.arrivals]
    created = _event_times(bootstrap, [i for i, _ in arrivals])
    latencies = [(t - created[i]) * 1000 for i, t in arrivals if i in created]
    tokens = sum(r.tokens for r in requests)
    whole = "".join(sim_token_text(i) for i in range(max_tokens))
    return {"streams": streams, "tokens_per_s_per_stream": tokens_per_s,
            # Replies whose streamed text is every token once, in order: none dropped,
            # none merged away, none repeated.
            "replies": len(requests), "intact": sum("".join(r.text) == whole for r in requests),
            "offered_tokens_per_s": streams * tokens_per_s, "deltas": len(latencies),
            "seconds": seconds, "failures": sum(r.error is not None for r in requests),
            "deltas_per_s": len(latencies) / seconds,
            **{key: (transactions[False][key] - transactions[True][key]) / seconds
               for key in counters},
            # From a request sent to its first content (the SIMULATED engine's TTFT is in it).
            "ttft_ms": {f"p{q}": percentile([r.ttft * 1000 for r in requests
                                             if r.ttft is not None], q) for q in (50, 99)},
            "ms": {f"p{q}": percentile(latencies, q) for q in (50, 90, 99)} | {
                "max": max(latencies, default=float("nan"))},
            "kafka_hop_ms": {f"p{q}": percentile(hop_ms, q) for q in (50, 90, 99)},
            "client_cpu": client_cpu, "gateway_cpu": gateway_cpu, "machine_cpu": machine,
            "tokens": tokens, "cpu_s": {**used, "load generator": client_cpu * seconds},
            "cpu_us_per_token": {name: cpu_s / tokens * 1e6 for name, cpu_s in
                                 {**used, "load generator": client_cpu * seconds}.items()}
            if tokens else {}}


def throughput(bootstrap: str, log_dir: Path, streams: int, rounds: int,
               gateways: int = 1) -> dict[str, Any]:
    """Streams fast enough to saturate the machine through ``gateways`` gateway processes
    on one port: the tokens/s their clients get, and the gateways' CPU."""
    with _stack(bootstrap, log_dir, {"WORKER_SIM_TOKENS_PER_S": "1000", "WORKER_SIM_TTFT_MS": "0"},
                gateways=gateways) as (url, pids, _):
        roots = {"gateway": pids["gateway"]}
        before = _cpu_snapshot(roots)
        requests, seconds, client_cpu = asyncio.run(_load(url, streams, rounds, 1000, False))
        gateway_cpu = _cpu_used(before, _cpu_snapshot(roots))["gateway"] / seconds
    tokens = sum(r.tokens for r in requests if r.error is None)
    return {"streams": streams, "gateways": gateways, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "failures": sum(r.error is not None for r in requests),
            "client_cpu": client_cpu, "gateway_cpu": gateway_cpu}


async def _hold(url: str, streams: int, gateway: int) -> dict[str, Any]:
    opened = 0
    all_open = asyncio.Event()
    async with http_client(streams + 8) as client:
        await stream_once(client, url, chat_body("sim", "warm", 2, 0))
        baseline = _rss_mb(gateway)

        async def hold(seed: int) -> None:
            nonlocal opened
            body = chat_body("sim", "hold", 8_000, seed)  # at 0.2 tokens/s: hours
            async with client.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"a held stream was refused: {resp.status} "
                                       f"{(await resp.read())[:300]!r}")
                async for line in resp.content:
                    if line.startswith(b"data: ") and b'"error":{' in line:
                        raise RuntimeError(f"a held stream failed: {line[:200]!r}")
                    if line.startswith(b"data: ") and b'"content":"' in line:
                        opened += 1
                        if opened == streams:
                            all_open.set()
                        await asyncio.Event().wait()  # hold it open until cancelled
            raise RuntimeError("a held stream ended")

        started = time.perf_counter()
        tasks = [asyncio.create_task(hold(i)) for i in range(streams)]
        opening = asyncio.create_task(all_open.wait())
        try:
            await asyncio.wait([opening, *tasks], timeout=300,
                               return_when=asyncio.FIRST_COMPLETED)
            failed = next((t for t in tasks if t.done()), None)
            if failed is not None:
                failed.result()  # raises what went wrong
            if not all_open.is_set():
                raise TimeoutError(f"only {opened} of {streams} streams opened in 300 s")
            seconds = time.perf_counter() - started
            await asyncio.sleep(2)  # let allocations settle
            held = _rss_mb(gateway)
            async with client.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
        finally:
            for task in (*tasks, opening):
                task.cancel()
            await asyncio.gather(*tasks, opening, return_exceptions=True)
    return {"streams": streams,
            "gateway_active_streams": _sample(metrics, "gateway_active_streams"),
            "open_seconds": seconds,
            "rss_mb_before": baseline, "rss_mb_held": held,
            "kb_per_stream": (held - baseline) * 1024 / streams}


def open_streams(bootstrap: str, log_dir: Path, streams: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one socket per stream, twice
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * streams + 1024)), hard))
    with _stack(bootstrap, log_dir, {"WORKER_SIM_TOKENS_PER_S": "0.2", "WORKER_SIM_TTFT_MS": "0"},
                max_num_seqs=max(streams, 8192)) as (url, pids, _):
        return asyncio.run(_hold(url, streams, pids["gateway"]))


def _step(what: str, measure: Callable[[], T], found: Callable[[T], str]) -> T:
    """One step of the bench, said before it runs and with what it found after: a full
    run takes minutes, and each step's stack a while to start."""
    print(f"capacity: {what} ...", flush=True)
    started = time.monotonic()
    result = measure()
    print(f"capacity: {what}: {found(result)} ({time.monotonic() - started:.0f} s)",
          flush=True)
    return result


def _latency_found(lat: dict[str, Any]) -> str:
    return (f"p50 / p99 {lat['ms']['p50']:.1f} / {lat['ms']['p99']:.1f} ms, "
            f"{total_per_token(lat):,.0f} µs per token, "
            f"{lat['intact']:,} of {lat['replies']:,} replies intact")


def run(bootstrap: str, quick: bool, log_dir: Path) -> dict[str, Any]:
    rates = (5, 50) if quick else (5, 10, 20, 50)
    held = 500 if quick else 10_000
    steps = len(rates) + 4
    # Not recorded: a broker started minutes before spends its first minutes compiling
    # (its JIT); a run straight after ``pipeline infra up`` charged the first point
    # twice the broker CPU per token of the same point run again.
    _step(f"[1/{steps}] warming the broker at 256 x 20, not recorded",
          lambda: delta_latency(bootstrap, log_dir, 256, 1, 20), _latency_found)
    latency = []
    for i, rate in enumerate(rates, start=2):
        latency.append(_step(
            f"[{i}/{steps}] delta latency at 256 streams x {rate} tokens/s",
            functools.partial(delta_latency, bootstrap, log_dir, 256, 1 if quick else 4,
                              rate),
            _latency_found))
    gateway_tps = []
    for i, gateways in enumerate((1, 2), start=len(rates) + 2):
        gateway_tps.append(_step(
            f"[{i}/{steps}] tokens/s of {gateways} gateway process{'es' * (gateways > 1)}",
            functools.partial(throughput, bootstrap, log_dir, 64 if quick else 128,
                              1 if quick else 3, gateways),
            lambda thr: f"{thr['tokens_per_s']:,.0f} tokens/s"))
    return {
        "sim_clock": SIM_CLOCK,
        "delta_latency": latency,
        "throughput": gateway_tps,
        "open_streams": _step(f"[{steps}/{steps}] {held:,} streams held open in one gateway",
                              lambda: open_streams(bootstrap, log_dir, held),
                              lambda found: f"{found['kb_per_stream']:.0f} KB per stream"),
    }


def total_per_token(lat: dict[str, Any]) -> float:
    per: dict[str, float] = lat["cpu_us_per_token"]
    return sum(per.get(name, 0.0) for name in COMPONENTS)


def _by_component(figures: dict[str, Any], after: dict[str, Any] | None = None) -> list[str]:
    """The per-component CPU table; given the figures of a later run, a last column with
    the later total over this one at the same load."""
    later = {(lat["streams"], lat["tokens_per_s_per_stream"]): total_per_token(lat)
             for lat in (after or {}).get("delta_latency", []) if lat.get("cpu_us_per_token")}
    out = ["| streams x tokens/s each | tokens/delta | " + " | ".join(COMPONENTS)
           + " | total (all but the load generator) | load generator |"
           + (" total after / before |" if after else ""),
           "|---" * (len(COMPONENTS) + 4 + bool(after)) + "|"]
    for lat in figures["delta_latency"]:
        per = lat.get("cpu_us_per_token")
        if not per:
            continue
        total = total_per_token(lat)
        ratio = later.get((lat["streams"], lat["tokens_per_s_per_stream"]))
        out.append(f"| {lat['streams']} x {lat['tokens_per_s_per_stream']:g} | "
                   f"{lat['tokens'] / max(lat['deltas'], 1):.2f} | "
                   + " | ".join(f"{per.get(name, 0.0):,.0f}" for name in COMPONENTS)
                   + f" | {total:,.0f} | {per.get('load generator', 0.0):,.0f} |"
                   + ((f" {ratio / total:.2f}x |" if ratio else " |") if after else ""))
    return out


def tables(figures: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """The report's tables; ``before``: an earlier run's figures, to set beside them."""
    held = figures["open_streams"]
    out = ["| streams x tokens/s each | deltas/s delivered | worker -> SSE client p50 / p90 "
           "/ p99 / max (ms) | of which worker -> Kafka consumer p50 / p90 / p99 (ms) | "
           "machine CPU (2 = all cores) | gateway CPU | load generator CPU | replies with "
           "every token once, in order | Kafka transactions/s, worker / gateway |",
           "|---|---|---|---|---|---|---|---|---|"]
    for lat in figures["delta_latency"]:
        ms, hop = lat["ms"], lat["kafka_hop_ms"]
        out.append(f"| {lat['streams']} x {lat['tokens_per_s_per_stream']:g} | "
                   f"{lat['deltas_per_s']:,.0f} | {ms['p50']:.1f} / {ms['p90']:.1f} / "
                   f"{ms['p99']:.1f} / {ms['max']:.0f} | {hop['p50']:.1f} / "
                   f"{hop['p90']:.1f} / {hop['p99']:.1f} | "
                   f"{lat['machine_cpu'] * (os.cpu_count() or 1):.2f} | "
                   f"{lat['gateway_cpu']:.0%} | {lat['client_cpu']:.0%} | "
                   f"{lat.get('intact', 0):,} of {lat.get('replies', 0):,} | "
                   f"{lat.get('transactions_per_s', 0):.0f} / "
                   f"{lat.get('gateway_transactions_per_s', 0):.0f} |")
    out += ["", "CPU per delivered token, by component (µs; each process's user + system time "
            "from /proc over the measured window, divided by the tokens the clients got):", "",
            *_by_component(figures)]
    if before:
        machine = ("the same machine" if before.get("machine") == figures.get("machine")
                   else before.get("machine", "another machine"))
        then = before.get("sim_clock", "a clock per sequence")
        engine = ("same engine" if then == figures.get("sim_clock") else
                  f"the SIMULATED engine then had {then}, now {figures.get('sim_clock')}, so "
                  "the ratios include that change")
        out += ["", f"Before ({before['measured_at']}, {before.get('code', 'earlier code')}; "
                f"{machine}, same load; {engine}):", "", *_by_component(before, figures)]
    out += ["", "| figure | value | load generator CPU | gateway CPU |", "|---|---|---|---|"]
    for thr in figures["throughput"]:
        processes = f"{thr['gateways']} gateway process{'es' * (thr['gateways'] > 1)}"
        out.append(f"| tokens/s {processes} on one port stream to SSE clients "
                   f"({thr['streams']} streams) | {thr['tokens_per_s']:,.0f} | "
                   f"{thr['client_cpu']:.0%} | {thr['gateway_cpu']:.0%} |")
    out += [f"| streams held open in one gateway | {held['streams']:,} (memory "
            f"{held['rss_mb_before']:.0f} -> {held['rss_mb_held']:.0f} MB, "
            f"{held['kb_per_stream']:.0f} KB per stream) | | |"]
    return "\n".join(out)
