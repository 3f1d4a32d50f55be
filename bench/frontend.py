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

Then the same load alternates between that engine and a ``VllmProcess`` (vLLM's front
end in a child process, what a worker runs by default), both detokenising: this
process's CPU per token with vLLM's front end in it and with it out, and the child's.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

from schemas import ChatMessage, SamplingParams
from workers.engine import Engine, EngineRequest
from workers.vllm_engine import VllmEngine
from workers.vllm_process import VllmProcess

MESSAGES = (ChatMessage(role="user", content="Tell me about the sea."),)
# Between rounds of two engines: vLLM's engine core polls for 1 s after its last step.
SETTLE_S = 1.5


def _engine(clients: int, where: str = "inline") -> Engine:
    from pipeline.settings import CommonSettings
    from workers.settings import WorkerSettings
    from workers.tiny_model import TINY_MODEL_NAME, make_tiny_model

    path = make_tiny_model(CommonSettings().state_dir / "models" / TINY_MODEL_NAME)
    settings = WorkerSettings(max_num_seqs=clients, max_model_len=512, load_format="dummy")
    if where == "process":
        return VllmProcess(settings, path, TINY_MODEL_NAME)
    return VllmEngine(settings, path, TINY_MODEL_NAME)


async def one_round(engine: Engine, clients: int, tokens: int, detokenize: bool,
                    requests: int = 2) -> tuple[float, int, int]:
    """This process's CPU per token (µs) over ``requests`` requests of each client, the
    tokens, and the characters of text the engine gave. ``detokenize``: whether an
    in-process engine detokenises (a front-end process always does)."""
    if isinstance(engine, VllmEngine):
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
        split = await _split(engine, quick, clients, tokens)
    finally:
        engine.close()
    ratios = [b / a for a, b in zip(on, off, strict=True)]
    return {"clients": clients, "tokens": tokens, "pairs": len(ratios),
            "detokenising_us": statistics.median(on), "not_detokenising_us": statistics.median(off),
            "ratio": statistics.median(ratios), "least_ratio": min(ratios),
            "most_ratio": max(ratios), **split}


async def _split(inline: Engine, quick: bool, clients: int, tokens: int) -> dict[str, Any]:
    """Rounds alternating between ``inline`` and a front-end process, in pairs."""
    from bench.capacity import _cpu_s

    child = _engine(clients, "process")
    assert isinstance(child, VllmProcess)
    try:
        await one_round(child, clients, tokens, True, requests=1)  # warm-up
        here: list[float] = []
        out: list[float] = []
        child_us: list[float] = []  # the child's, per token of its round
        for i in range(2 if quick else 6):
            for engine in ((inline, child) if i % 2 == 0 else (child, inline)):
                await asyncio.sleep(SETTLE_S)  # the other's engine core polls on a while
                before = _cpu_s(child.pid)
                us, counted, _ = await one_round(engine, clients, tokens, True)
                (out if engine is child else here).append(us)
                if engine is child:
                    child_us.append((_cpu_s(child.pid) - before) / max(counted, 1) * 1e6)
    finally:
        child.close()
    ratios = [b / a for a, b in zip(here, out, strict=True)]
    # The two processes together against the one: what the split costs in all.
    together = [(b + c) / a for a, b, c in zip(here, out, child_us, strict=True)]
    return {"inline_us": statistics.median(here), "process_us": statistics.median(out),
            "frontend_process_us": statistics.median(child_us),
            "split_ratio": statistics.median(ratios), "split_least": min(ratios),
            "split_most": max(ratios), "together_ratio": statistics.median(together),
            "together_least": min(together), "together_most": max(together)}


def run(quick: bool, clients: int = 32, tokens: int = 128) -> dict[str, Any]:
    import uvloop

    # On uvloop, as a worker runs (``launch.services``), and as the front-end process does.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_pairs(quick, clients, tokens))


def table(figures: dict[str, Any]) -> str:
    saved = figures["detokenising_us"] - figures["not_detokenising_us"]
    return "\n".join([
        "| clients | tokens a reply | µs per token, detokenising | not detokenising | "
        "saved | ratio (least - most) |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {figures['clients']} | {figures['tokens']} | {figures['detokenising_us']:.1f} | "
        f"{figures['not_detokenising_us']:.1f} | {saved:.1f} | {figures['ratio']:.2f}x "
        f"({figures['least_ratio']:.2f} - {figures['most_ratio']:.2f}) |",
        "",
        "| clients | tokens a reply | this process, vLLM's front end in it (µs per token) | "
        "with it in a process of its own | ratio (least - most) | that process | "
        "both processes / the one (least - most) |",
        "|---:|---:|---:|---:|---|---:|---|",
        f"| {figures['clients']} | {figures['tokens']} | {figures['inline_us']:.1f} | "
        f"{figures['process_us']:.1f} | {figures['split_ratio']:.2f}x "
        f"({figures['split_least']:.2f} - {figures['split_most']:.2f}) | "
        f"{figures['frontend_process_us']:.1f} | {figures['together_ratio']:.2f}x "
        f"({figures['together_least']:.2f} - {figures['together_most']:.2f}) |"])
