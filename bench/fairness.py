"""``pipeline bench fairness``: how a worker shares its engine between tenants. A
SIMULATED worker (16 slots, 20 tokens/s per turn) is fed prompts written straight to
``chat.prompts`` (no gateway: the worker's order is what is measured), in four ways:

* **fair, preemptive**: the default: the token-weighted fair share, slots taken back
  for a tenant below its share (``workers/fairness.py``);
* **fair**: the same without taking slots back (``WORKER_PREEMPT=false``);
* **fair, capped**: that with ``WORKER_MAX_RUNNING_PER_TENANT=8``;
* **log order**: ``WORKER_SCHEDULING=fifo``, the order before the fair share.

Three scenarios each:

* **a backlog and a latecomer**: tenant alpha writes 200 turns of 2,000 tokens (each
  holds a slot 100 s), then, once they hold every slot, tenant beta 5 turns of 16;
  beta's time from its prompt to its first token, against beta alone on an idle worker
  (after a first round of beta's, not counted). Only beta's turns are waited for; one
  that has not started within ``LATE_WINDOW_S`` counts as that long.
* **two backlogs**: alpha writes 100 turns, then beta 100, at once; Jain's fairness index
  over the tokens each was served while both had turns waiting (1: equal shares, 0.5:
  one tenant had everything), as llm-d's fairness work reports it; and the tokens per
  second of both together.
* **one tenant**: alpha alone writes 100 turns of 64 tokens: its tokens per second, from
  its first turn's start to its last's end (what taking slots back must not cost).

A turn's first token is its ``GenerationStarted`` (written at the first token); its tokens
are counted as served evenly between that and its ``GenerationFinished``.
"""

from __future__ import annotations

import math
import statistics
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stack import sim_worker
from pipeline.codec import CLEAR, conversation_key, parse
from pipeline.kafka.plain import PlainReader, PlainWriter
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SamplingParams,
)

SLOTS = 16
TOKENS_PER_S = 20
LONG_TOKENS = 2_000
LATE_WINDOW_S = 60.0
SIDES: tuple[tuple[str, dict[str, str]], ...] = (
    ("fair, preemptive", {}), ("fair", {"WORKER_PREEMPT": "false"}),
    ("fair, capped", {"WORKER_PREEMPT": "false", "WORKER_MAX_RUNNING_PER_TENANT": "8"}),
    ("log order", {"WORKER_SCHEDULING": "fifo"}))


@dataclass
class Turn:
    tenant: str
    sent: float  # wall clock
    started: float | None = None
    finished: float | None = None
    tokens: int = 0


def jain(values: list[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else float("nan")


def _send(producer: PlainWriter, model: str, tenant: str, count: int, tokens: int,
          turns: dict[str, Turn]) -> None:
    for i in range(count):
        conversation = uuid.uuid4()
        request_id = f"fair-{tenant}-{i}-{uuid.uuid4().hex[:8]}"
        prompt = PromptSubmitted(
            conversation_id=conversation, request_id=request_id, tenant=tenant, model=model,
            messages=(ChatMessage(role="user", content=f"{tenant} turn {i}"),),
            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True))
        turns[request_id] = Turn(tenant, time.time())
        producer.send(PROMPTS, conversation_key(conversation), CLEAR.encode(prompt))
    failed = producer.flush(30)
    assert not failed, f"prompts not written: {failed[0]}"


def _follow(bootstrap: str, since_ms: int, turns: dict[str, Turn], timeout: float,
            censored: bool = False) -> None:
    """Read each turn's start and end from ``chat.generations`` until all have ended
    (``censored``: or ``timeout`` passed; else that is an error)."""
    consumer = PlainReader(bootstrap, "bench-fairness")
    try:
        consumer.start_at_time(GENERATIONS, since_ms)
        deadline = time.monotonic() + timeout
        while any(t.finished is None for t in turns.values()):
            if time.monotonic() >= deadline:
                assert censored, "turns did not end in time"
                return
            for msg in consumer.read(1000, 0.5):
                if msg.value is None:
                    continue
                try:
                    event = parse(msg.value)
                except ValueError:
                    continue
                turn = turns.get(event.request_id)
                if turn is None:
                    continue
                at = event.occurred_at.timestamp()
                if isinstance(event, GenerationStarted) and turn.started is None:
                    turn.started = at
                elif isinstance(event, GenerationFinished):
                    turn.finished, turn.tokens = at, event.usage.completion_tokens
                elif isinstance(event, GenerationFailed):
                    turn.finished = at
    finally:
        consumer.close()


def _served(turns: list[Turn], start: float, end: float) -> float:
    """Tokens these turns were served between ``start`` and ``end``, each turn's spread
    evenly over its run."""
    total = 0.0
    for t in turns:
        if t.started is None or t.finished is None or t.finished <= t.started:
            continue
        overlap = min(t.finished, end) - max(t.started, start)
        if overlap > 0:
            total += t.tokens * overlap / (t.finished - t.started)
    return total


def _waits(turns: list[Turn], window_s: float | None = None) -> list[float]:
    """Each turn's time to its first token (ms); one not started counts as ``window_s``."""
    return sorted((t.started - t.sent) * 1000 if t.started is not None
                  else (window_s or math.inf) * 1000 for t in turns)


def _rate(turns: list[Turn]) -> float:
    """Tokens per second of these turns together, first start to last end."""
    start = min(t.started for t in turns if t.started is not None)
    end = max(t.finished for t in turns if t.finished is not None)
    return sum(t.tokens for t in turns) / (end - start)


def _holding(metrics: str, slots: int, timeout: float = 60.0) -> None:
    """Until the worker runs ``slots`` turns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(metrics, timeout=2) as resp:
            text = resp.read().decode()
        if any(line.startswith("worker_running_sequences ") and float(line.split()[1]) >= slots
               for line in text.splitlines()):
            return
        time.sleep(0.1)
    raise AssertionError(f"the worker never ran {slots} turns")


def run(bootstrap: str, log_dir: Path, quick: bool) -> dict[str, Any]:
    producer = PlainWriter(bootstrap, "bench-fairness")
    backlog = 60 if quick else 200
    both = 40 if quick else 100
    alone_turns = 40 if quick else 100
    results: dict[str, Any] = {}
    for i, (side, env) in enumerate(SIDES, 1):
        model = f"sim-fairness-{uuid.uuid4().hex[:6]}"
        print(f"[{i}/{len(SIDES)}] {side} ...", flush=True)
        with sim_worker(bootstrap, log_dir / f"fairness-{model}.log", model, SLOTS,
                        TOKENS_PER_S, env) as (metrics, _):
            since = int(time.time() * 1000) - 5000
            # The worker's first turns (its partitions' ledgers read, its first batches)
            # are slower than any after: a round first, not counted.
            first: dict[str, Turn] = {}
            _send(producer, model, "beta", 5, 16, first)
            _follow(bootstrap, since, first, 120)
            alone: dict[str, Turn] = {}
            _send(producer, model, "beta", 5, 16, alone)
            _follow(bootstrap, since, alone, 120)
            single: dict[str, Turn] = {}
            _send(producer, model, "alpha", alone_turns, 64, single)
            _follow(bootstrap, since, single, 900)
            pair: dict[str, Turn] = {}
            _send(producer, model, "alpha", both, 32, pair)
            _send(producer, model, "beta", both, 32, pair)
            _follow(bootstrap, since, pair, 900)
            # Last: alpha's long turns are never waited for (the worker stops after).
            longs: dict[str, Turn] = {}
            _send(producer, model, "alpha", backlog, LONG_TOKENS, longs)
            _holding(metrics, int(env.get("WORKER_MAX_RUNNING_PER_TENANT", SLOTS)))
            late: dict[str, Turn] = {}
            _send(producer, model, "beta", 5, 16, late)
            _follow(bootstrap, since, late, LATE_WINDOW_S, censored=True)
        beta_alone = _waits(list(alone.values()))
        beta_late = _waits(list(late.values()), LATE_WINDOW_S)
        by = {tenant: [t for t in pair.values() if t.tenant == tenant]
              for tenant in ("alpha", "beta")}
        start = min(t.sent for t in pair.values())
        # While both had turns waiting: until the first of them had its last turn start.
        end = min(max(t.started or 0.0 for t in ts) for ts in by.values())
        served = {tenant: _served(ts, start, end) for tenant, ts in by.items()}
        results[side] = {
            "beta_alone_first_token_ms": beta_alone,
            "beta_behind_alpha_first_token_ms": beta_late,
            "beta_median_ratio": statistics.median(beta_late) / statistics.median(beta_alone),
            "both_window_s": end - start, "both_served_tokens": served,
            "jain": jain(list(served.values())),
            "both_tokens_per_s": _rate(list(pair.values())),
            "one_tenant_tokens_per_s": _rate(list(single.values()))}
        r = results[side]
        print(f"      beta's first token: median {statistics.median(beta_late):.0f} ms behind "
              f"alpha's {backlog} turns, {statistics.median(beta_alone):.0f} ms alone "
              f"({r['beta_median_ratio']:.2f}x); two backlogs: Jain {r['jain']:.3f}, "
              f"{r['both_tokens_per_s']:.0f} tokens/s; one tenant: "
              f"{r['one_tenant_tokens_per_s']:.0f} tokens/s", flush=True)
    return {"backlog": backlog, "long_tokens": LONG_TOKENS, "window_s": LATE_WINDOW_S,
            "both": both, "one_tenant_turns": alone_turns, "slots": SLOTS,
            "tokens_per_s": TOKENS_PER_S, "results": results}


def table(figures: dict[str, Any]) -> str:
    window = figures["window_s"] * 1000
    base = figures["results"]["log order"]

    def ms(value: float) -> str:
        return f"≥ {value:,.0f}" if value >= window else f"{value:,.0f}"

    out = ["| worker | beta's first token alone, median / max (ms) | behind alpha's "
           f"{figures['backlog']} turns of {figures['long_tokens']:,}, median / max (ms) | "
           "ratio of medians | two backlogs of {0}: tokens served alpha / beta | Jain's "
           "index | two backlogs, tokens/s | one tenant, tokens/s (vs log order) |".format(
               figures["both"]),
           "|---|---|---|---|---|---|---|---|"]
    for side, r in figures["results"].items():
        alone, late = r["beta_alone_first_token_ms"], r["beta_behind_alpha_first_token_ms"]
        served = r["both_served_tokens"]
        one = r["one_tenant_tokens_per_s"]
        out.append(f"| {side} | {statistics.median(alone):,.0f} / {max(alone):,.0f} | "
                   f"{ms(statistics.median(late))} / {ms(max(late))} | "
                   f"{'≥ ' if statistics.median(late) >= window else ''}"
                   f"{r['beta_median_ratio']:.2f}x | {served['alpha']:,.0f} / "
                   f"{served['beta']:,.0f} | {r['jain']:.3f} | {r['both_tokens_per_s']:,.0f} | "
                   f"{one:,.0f} ({one / base['one_tenant_tokens_per_s']:.1%}) |")
    return "\n".join(out)
