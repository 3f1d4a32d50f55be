"""``pipeline bench hotpath``: the worker's own CPU per token on the path every token
takes, in process (no Kafka, no engine): ``turns`` running turns each take one output
per engine step (``workers.turn``: the start at the first, then the inter-token metric
and the text held for the open record), and once per step the live records are made
(a delta per turn: the tokens counted, the fair share's counters), each turn's text
sealed with its conversation's key (``workers.output``), and handed to a writer that
drops them, on an event loop as in the worker.

It is the share of the worker that grows with tokens, measured apart from the host's
noise around a whole stack (``pipeline bench pair`` measures the whole worker). Its
figures are process CPU per token, the median of the rounds. For a comparison finer
than a noisy host allows, count instructions instead: run it under
``valgrind --tool=cachegrind`` at two values of ``run``'s ``steps`` and divide the
difference of the instructions by rounds x ``turns`` x the difference of the steps
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from bench.sealing import DroppingWriter, MemoryRing
from pipeline import sealing
from pipeline.codec import Codec


def _takers(turns: int, partitions: int) -> tuple[list[Any], Any, DroppingWriter]:
    """``turns`` turns started on a runner whose output seals, and that output."""
    from prometheus_client import CollectorRegistry

    from schemas import ChatMessage, PromptSubmitted
    from workers.metrics import Readings, WorkerMetrics
    from workers.output import Output
    from workers.plan import Progress
    from workers.turn import Runner, Turn, _Taker

    class Engine:  # what the metrics and the runner read of an engine
        model_name, max_num_seqs = "bench", turns

        def running(self) -> int:
            return turns

        def kv_cache_usage(self) -> float | None:
            return None

    ring, writer, engine = MemoryRing(), DroppingWriter(), Engine()
    output = Output(writer, "bench", Codec(sealing.Cipher(ring)))  # type: ignore[arg-type]
    metrics = WorkerMetrics(CollectorRegistry(), engine,  # type: ignore[arg-type]
                            Readings(*[lambda: 0] * 5))
    runner = Runner(engine, output, writer, None, metrics, "bench",  # type: ignore[arg-type]
                    lambda *_, **__: None)
    takers = []
    for i in range(turns):
        conversation = uuid.uuid4()
        ring.add(conversation)
        prompt = PromptSubmitted(conversation_id=conversation, request_id=f"r{i}",
                                 model="bench", history_len=0,
                                 messages=(ChatMessage(role="user", content="hello"),))
        turn = Turn(prompt, ("chat.prompts", i % partitions), 1000 + i, Progress(), 0,
                    seal=ring.keys[conversation])
        takers.append(_Taker(runner, turn))
    return takers, output, writer


async def _round(turns: int, steps: int, partitions: int) -> float:
    from workers.output import GATHER_PASSES

    takers, _, _ = _takers(turns, partitions)
    for taker in takers:  # each turn's start: not the per-token path
        taker.take("first ", (999,), 5, None)
    for _ in range(GATHER_PASSES):
        await asyncio.sleep(0)
    texts = [(f"t{s} ", (1000 + s,)) for s in range(steps)]
    started = time.process_time()
    for text, token_ids in texts:
        for taker in takers:
            taker.take(text, token_ids, 5, None)
        for _ in range(GATHER_PASSES):  # the step's records made, as in the worker
            await asyncio.sleep(0)
    return (time.process_time() - started) / (turns * steps) * 1e6


def run(quick: bool, turns: int = 256, steps: int | None = None,
        partitions: int = 6) -> dict[str, Any]:
    rounds = 3 if quick else 9
    steps = steps or (50 if quick else 400)
    per_token = [asyncio.run(_round(turns, steps, partitions)) for _ in range(rounds)]
    return {"turns": turns, "steps": steps, "partitions": partitions, "rounds": rounds,
            "us_per_token": statistics.median(per_token),
            "least_us_per_token": min(per_token)}


def table(figures: dict[str, Any]) -> str:
    return "\n".join([
        "| turns | steps | partitions | µs per token (median) | least |",
        "|---:|---:|---:|---:|---:|",
        f"| {figures['turns']} | {figures['steps']} | {figures['partitions']} | "
        f"{figures['us_per_token']:.2f} | {figures['least_us_per_token']:.2f} |"])
