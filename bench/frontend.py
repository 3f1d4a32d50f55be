"""``pipeline bench frontend``: what vLLM's front end costs in the worker's process, with
detokenising and without. One ``VllmEngine`` (the tiny model, random weights, on this
CPU) serves ``clients`` closed-loop requests of ``tokens`` tokens each. Its rounds
alternate with and without detokenising (``SamplingParams.detokenize``, per request) on
the same engine. A round's figure is this process's CPU per token: vLLM's front end
(its output processing, the worker's pump and the sinks) and the clients, but not vLLM's
engine core, a process of its own, whose compute a GPU would do. The ratio is the
median of adjacent rounds' ratios.

It tells what taking detokenising off the worker would save: the worker's target is 20
µs of its process's CPU per token, vLLM's output processing included
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from schemas import ChatMessage, SamplingParams
from workers.engine import EngineRequest
from workers.vllm_engine import VllmEngine

MESSAGES = (ChatMessage(role="user", content="Tell me about the sea."),)


def _engine(clients: int) -> VllmEngine:
    from pipeline.settings import CommonSettings
    from workers.settings import WorkerSettings
    from workers.tiny_model import TINY_MODEL_NAME, make_tiny_model

    path = make_tiny_model(CommonSettings().state_dir / "models" / TINY_MODEL_NAME)
    settings = WorkerSettings(max_num_seqs=clients, max_model_len=512, load_format="dummy")
    return VllmEngine(settings, path, TINY_MODEL_NAME)


async def one_round(engine: VllmEngine, clients: int, tokens: int, detokenize: bool,
                    requests: int = 2) -> tuple[float, int, int]:
    """This process's CPU per token (µs) over ``requests`` requests of each client, the
    tokens, and the characters of text the engine gave."""
    engine.detokenize = detokenize
    counted = chars = 0

    def take(text: str, token_ids: tuple[int, ...], *_: object) -> None:
        nonlocal counted, chars
        counted += len(token_ids)
        chars += len(text)

    async def client(number: int) -> None:
        for k in range(requests):
            sampling = SamplingParams(max_tokens=tokens, seed=number * requests + k,
                                      ignore_eos=True)
            await engine.run(EngineRequest(uuid.uuid4().hex, MESSAGES, sampling), take)

    started = time.process_time()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return (time.process_time() - started) / max(counted, 1) * 1e6, counted, chars


async def _pairs(quick: bool, clients: int, tokens: int) -> dict[str, Any]:
    engine = _engine(clients)
    try:
        await one_round(engine, clients, tokens, True, requests=1)  # warm-up
        on: list[float] = []
        off: list[float] = []
        for _ in range(2 if quick else 6):
            on.append((await one_round(engine, clients, tokens, True))[0])
            off.append((await one_round(engine, clients, tokens, False))[0])
    finally:
        engine.close()
    ratios = [b / a for a, b in zip(on, off, strict=True)]
    return {"clients": clients, "tokens": tokens, "pairs": len(ratios),
            "detokenising_us": statistics.median(on), "not_detokenising_us": statistics.median(off),
            "ratio": statistics.median(ratios), "least_ratio": min(ratios),
            "most_ratio": max(ratios)}


def run(quick: bool, clients: int = 32, tokens: int = 128) -> dict[str, Any]:
    return asyncio.run(_pairs(quick, clients, tokens))


def table(figures: dict[str, Any]) -> str:
    saved = figures["detokenising_us"] - figures["not_detokenising_us"]
    return "\n".join([
        "| clients | tokens a reply | µs per token, detokenising | not detokenising | "
        "saved | ratio (least - most) |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {figures['clients']} | {figures['tokens']} | {figures['detokenising_us']:.1f} | "
        f"{figures['not_detokenising_us']:.1f} | {saved:.1f} | {figures['ratio']:.2f}x "
        f"({figures['least_ratio']:.2f} - {figures['most_ratio']:.2f}) |"])
