"""``pipeline bench worker``: one SIMULATED worker alone at a GPU's rate, its process's
CPU per token. The issue's point is 256 sequences at 100 tokens/s each (25,600 tokens/s:
what one worker must carry beside an H100), which the whole stack cannot reach on a
small host (its gateway, broker and load generator share the cores), so nothing runs
here but the worker and the broker.

Prompts are written straight to ``chat.prompts`` as a gateway writes them: each of its
own conversation, whose data key the bench makes and writes to ``chat.keys`` first
(``Keyring.new_key``), and sealed with it. They arrive open loop a little faster than
``streams`` running turns end, each ``ignore_eos`` for ``turn_tokens``, so the engine's
``streams`` slots stay full. The worker (of a model of its own, its group started at the
prompts' end) fetches their keys, runs them on the SIMULATED engine (one step clock,
``workers.sim_engine``: its own share of the process is the model of vLLM handing over a
step's outputs) and writes their live records, each turn's text sealed, and their starts
and ends, in its transactions, as it does behind a gateway. No one reads ``chat.live``: a
gateway's tail costs the broker and the gateway, not the worker.

Measured over a window once the turns have filled the engine: the worker's process
CPU (user + system from /proc, every thread: the event loop, librdkafka's, the
transaction thread) and the broker's, divided by the tokens the worker generated in it
(its ``worker_generated_tokens`` counter), and its transactions and live records per
second.

With ``--a-tree`` or ``--b-tree`` (``paired``), two checkouts' workers are measured this
way in turns, A B B A ..., each pair's B / A ratio taken and the medians given.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.capacity import _cpu_snapshot, _cpu_used, _sample, _scrape
from bench.stack import sim_worker
from pipeline.codec import conversation_key
from pipeline.kafka import EventProducer, GroupConsumer
from pipeline.kafka.plain import PlainReader
from pipeline.keystore import Keyring
from pipeline.sealing import DataKey
from pipeline.topics import KEYS, PROMPTS, workers_group
from schemas import ChatMessage, PromptSubmitted, SamplingParams

# Counters read at the window's start and end: per second over it.
COUNTERS = {"tokens": "worker_generated_tokens_total",
            "transactions": "worker_transactions", "live_records": "worker_live_records"}


def _counters(metrics: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics, timeout=10) as resp:
        text = resp.read().decode()
    return {name: _sample(text, sample) for name, sample in COUNTERS.items()}


def _settled(bootstrap: str, model: str) -> None:
    """The model's group starts at the end of ``chat.prompts``, as though its workers had
    run every prompt before: the bench measures a worker serving, not one taking over."""
    reader = PlainReader(bootstrap, "bench-worker")
    try:
        ends = reader.ends(PROMPTS, reader.partitions(PROMPTS))
    finally:
        reader.close()
    consumer = GroupConsumer(bootstrap, workers_group(model), "bench")
    try:
        consumer.commit_sync({(PROMPTS, p): offset for p, offset in ends.items()})
    finally:
        asyncio.run(consumer.close())


async def _keys(producer: EventProducer, keyring: Keyring, count: int) -> list[DataKey]:
    """``count`` new conversations' data keys, durable in ``chat.keys``."""
    made = [keyring.new_key(uuid.uuid4(), "bench", None) for _ in range(count)]
    written = await asyncio.gather(*(producer.send_raw(KEYS, new.record_key, new.value,
                                                       partition=new.partition)
                                     for new in made))
    return [keyring.placed(new, at.offset) for new, at in zip(made, written, strict=True)]


async def _feed(producer: EventProducer, keyring: Keyring, keys: list[DataKey], model: str,
                turn_tokens: int, per_s: float) -> None:
    """One prompt per key, open loop at ``per_s``, sealed as a gateway seals them."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    written = []
    for i, key in enumerate(keys):
        due = began + i / per_s
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        conversation = key.conversation_id
        prompt = PromptSubmitted(
            conversation_id=conversation, request_id=f"bench-worker-{uuid.uuid4().hex}",
            tenant="bench", model=model, messages=(ChatMessage(role="user", content="go"),),
            sampling=SamplingParams(max_tokens=turn_tokens, ignore_eos=True))
        written.append(producer.send_raw(PROMPTS, conversation_key(conversation),
                                         keyring.codec.encode(prompt, key)))
    await asyncio.gather(*written)


async def _window(metrics: str, pid: int, slots: int, warm_s: float, seconds: float
                  ) -> dict[str, Any]:
    """The worker's and the broker's CPU and the worker's counters over ``seconds``, from
    ``warm_s`` after the engine's ``slots`` are all taken."""
    deadline = time.monotonic() + 300
    while await asyncio.to_thread(_scrape, metrics, "worker_running_sequences") < slots:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the worker never ran {slots} turns at once")
        await asyncio.sleep(0.2)
    await asyncio.sleep(warm_s)
    cpu, counters = _cpu_snapshot({"worker": pid}), await asyncio.to_thread(_counters, metrics)
    started = time.monotonic()
    await asyncio.sleep(seconds)
    cpu_after, after = _cpu_snapshot({"worker": pid}), await asyncio.to_thread(_counters,
                                                                               metrics)
    elapsed = time.monotonic() - started
    used = _cpu_used(cpu, cpu_after)
    tokens = after["tokens"] - counters["tokens"]
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "worker_cores": used["worker"] / elapsed,
            "worker_us_per_token": used["worker"] / max(tokens, 1) * 1e6,
            "broker_us_per_token": used["kafka broker"] / max(tokens, 1) * 1e6,
            "transactions_per_s": (after["transactions"] - counters["transactions"]) / elapsed,
            "live_records_per_s": (after["live_records"] - counters["live_records"]) / elapsed}


async def _measure(bootstrap: str, keyring: Keyring, metrics: str, pid: int, model: str,
                   keys: list[DataKey], turn_tokens: int, per_s: float, slots: int,
                   warm_s: float, seconds: float) -> dict[str, Any]:
    producer = EventProducer(bootstrap)
    try:
        feeding = asyncio.create_task(_feed(producer, keyring, keys, model, turn_tokens,
                                            per_s))
        figures = await _window(metrics, pid, slots, warm_s, seconds)
        feeding.cancel()  # what is left of the feed is not needed
        return figures
    finally:
        await asyncio.to_thread(producer.close)


def run(bootstrap: str, keyring: Keyring, log_dir: Path, quick: bool, streams: int = 256,
        rate: float = 100.0, tree: Path | None = None) -> dict[str, Any]:
    """``streams`` turns running at ``rate`` tokens/s each on one SIMULATED worker (of
    ``tree``'s code, this checkout's by default); see the module."""
    turn_s = 4.0
    turn_tokens = round(rate * turn_s)
    # Turns started a second: a tenth more than ``streams`` running at once finish, so the
    # engine's slots stay full and a few wait (as on a busy GPU).
    per_s = 1.1 * streams / turn_s
    warm_s, seconds = 2.0, (8.0 if quick else 20.0)
    count = round(per_s * (turn_s + warm_s + seconds + 5))
    model = f"sim-worker-{uuid.uuid4().hex[:6]}"
    print(f"writing {count:,} conversations' keys ...", flush=True)
    keys = asyncio.run(_with_producer(bootstrap, keyring, count))
    _settled(bootstrap, model)
    with sim_worker(bootstrap, log_dir / f"bench-worker-{model}.log", model, streams,
                    rate, {}, tree) as (metrics, pid):
        print(f"{streams} x {rate:g} tokens/s, turns of {turn_tokens} tokens; measured over "
              f"{seconds:g} s, {warm_s:g} s after the engine is full", flush=True)
        figures = asyncio.run(_measure(bootstrap, keyring, metrics, pid, model, keys,
                                       turn_tokens, per_s, streams, warm_s, seconds))
    return {"streams": streams, "rate": rate, "turn_tokens": turn_tokens, **figures}


async def _with_producer(bootstrap: str, keyring: Keyring, count: int) -> list[DataKey]:
    producer = EventProducer(bootstrap)
    try:
        return await _keys(producer, keyring, count)
    finally:
        await asyncio.to_thread(producer.close)


# What a run gives, in the tables' order: its key, its column's heading, its format.
FIGURES = (("tokens_per_s", "tokens/s generated", ",.0f"),
           ("worker_us_per_token", "worker µs/token", ".1f"),
           ("worker_cores", "worker cores", ".2f"),
           ("broker_us_per_token", "broker µs/token", ".1f"),
           ("transactions_per_s", "transactions/s", ".1f"),
           ("live_records_per_s", "live records/s", ".1f"))


def paired(bootstrap: str, keyring: Keyring, log_dir: Path, quick: bool, streams: int,
           rate: float, trees: dict[str, Path | None], pairs: int) -> dict[str, Any]:
    """Side A's worker and side B's (``trees``: their checkouts), measured in turns (A B B
    A A B ...); each figure's median per side, and the median of the pairs' B / A."""
    from bench.pair import order

    runs: list[tuple[str, int, dict[str, Any]]] = []
    for i, side in enumerate(order(pairs)):
        print(f"[{i + 1}/{2 * pairs}] side {side}", flush=True)
        runs.append((side, i // 2, run(bootstrap, keyring, log_dir, quick, streams, rate,
                                       trees[side])))
    return {"streams": streams, "rate": rate, "pairs": pairs,
            "trees": {side: _commit(tree) for side, tree in trees.items()},
            "runs": [{"side": s, "pair": at, "figures": f} for s, at, f in runs],
            "summary": summarise(runs)}


def _commit(tree: Path | None) -> str:
    """The commit a checkout is at (this one's if None), with ``+`` if it has changes."""
    where = str(tree or Path(__file__).resolve().parent.parent)
    head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
    changed = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=False).stdout.strip()
    return f"{head or where}{'+' if changed else ''}"


def summarise(runs: list[tuple[str, int, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each figure's median per side, and the median, least and most of the pairs' B / A
    (a pair without its A, or whose A is 0, counts in neither ratio)."""
    summary: dict[str, dict[str, float]] = {}
    for key, _, _ in FIGURES:
        by_pair: dict[int, dict[str, float]] = {}
        for side, at, figures in runs:
            by_pair.setdefault(at, {})[side] = figures[key]
        ratios = [p["B"] / p["A"] for p in by_pair.values() if p.get("A") and "B" in p]
        summary[key] = {side: statistics.median(f[key] for s, _, f in runs if s == side)
                        for side in ("A", "B")}
        if ratios:
            summary[key] |= {"ratio": statistics.median(ratios), "least": min(ratios),
                             "most": max(ratios)}
    return summary


def table(figures: dict[str, Any]) -> str:
    if "summary" in figures:
        rows = ["| figure | A | B | B / A (least - most) |", "|---|---:|---:|---|"]
        for key, heading, spec in FIGURES:
            f = figures["summary"][key]
            ratio = (f"{f['ratio']:.2f}x ({f['least']:.2f} - {f['most']:.2f})"
                     if "ratio" in f else "")
            rows.append(f"| {heading} | {f['A']:{spec}} | {f['B']:{spec}} | {ratio} |")
        return "\n".join(rows)
    return "\n".join([
        "| streams x tokens/s each | " + " | ".join(h for _, h, _ in FIGURES) + " |",
        "|---|" + "---:|" * len(FIGURES),
        f"| {figures['streams']} x {figures['rate']:g} | "
        + " | ".join(f"{figures[k]:{spec}}" for k, _, spec in FIGURES) + " |"])
