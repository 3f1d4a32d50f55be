"""The engine contract the worker drives: vLLM in production, a simulator for load tests.

An engine runs a step for all its sequences at once, and hands each sequence's output of
that step to the sequence's ``Sink`` from one loop of its own: one wake of the worker per
step, whatever the number of sequences, and no task woken per token. ``outputs`` reads a
request's outputs as an iterator instead, for a caller that has time (warm-up, tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from schemas import ChatMessage, SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    # Tokens an earlier attempt already emitted: the engine continues after them.
    prefix_token_ids: tuple[int, ...] = ()
    # The turn's trace context (W3C headers), for an engine that traces (vLLM).
    trace_headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class EngineOutput:
    """What one engine step produced for one request."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str | None = None  # set on the last output: stop | length | abort


# What an engine calls with each output of a request, from its step loop: the new text,
# the new token ids, the prompt's length in tokens, and the finish reason on the last
# output (stop | length | abort), else None. It must not block; what it raises fails
# that request alone (``Engine.run`` raises it).
Sink = Callable[[str, tuple[int, ...], int, str | None], None]
# What an engine's step loop asks between steps: an awaitable (awaited before the next
# step is handed out) while the reader of its outputs cannot take more, else None.
Pace = Callable[[], Awaitable[None] | None]


def unpaced() -> None:
    return None


class StallWatch:
    """Tells a stalled engine from an idle or a paced one: requests run, its reader is
    not pacing it, and it has handed out nothing for ``stall_s``
    (``WORKER_ENGINE_STALL_S``). A model process stopped or a GPU hung otherwise holds
    the worker's partitions with no turn moving, while the worker stays in its group."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._heard = 0.0
        self._paced = False

    def heard(self) -> None:
        """Outputs came (or the first request of an idle engine did)."""
        self._heard = time.monotonic()

    async def paced(self, wait: Awaitable[None]) -> None:
        """Await the reader's pace: no stall meanwhile."""
        self._paced = True
        try:
            await wait
        finally:
            self._paced = False
            self.heard()

    async def watch(self, running: Callable[[], int], stalled: Callable[[float], None]
                    ) -> None:
        """Call ``stalled`` with the seconds of quiet once the engine has stalled, and
        return; return too once no request runs."""
        while running():
            await asyncio.sleep(min(self.stall_s / 4, 5.0))
            quiet = time.monotonic() - self._heard
            if running() and not self._paced and quiet > self.stall_s:
                stalled(quiet)
                return


class EngineRejected(ValueError):
    """The engine refused the request itself (too long, bad parameters): not retryable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineSettingsRefused(ValueError):
    """The engine refuses the worker's settings (a step budget under the model's length,
    a length over the model's): the worker cannot start, and says why in one line."""


class EngineDead(RuntimeError):
    """The engine can no longer serve anything; the worker must exit. ``before``: the
    engine had died before the request this is raised for reached it, so that request
    is not what killed it (``workers.turn`` leaves it for the next owner)."""

    def __init__(self, message: str, before: bool = False) -> None:
        super().__init__(message)
        self.before = before

    def raised_before(self) -> EngineDead:
        """This death, as told to a request that came after it."""
        return EngineDead(str(self), before=True)


class Engine(Protocol):
    model_name: str
    max_num_seqs: int
    max_model_len: int
    # The most bytes of text one token stands for (None: not known): what lets a gateway
    # refuse a prompt that cannot fit ``max_model_len`` before it is written.
    max_token_bytes: int | None

    async def run(self, request: EngineRequest, sink: Sink) -> None:
        """Run ``request`` to its end, handing each of its outputs to ``sink`` (see
        ``Sink``); return once the last was handed. Raises ``EngineRejected`` or
        ``EngineDead``; cancelled, the request is aborted."""
        ...

    def pace(self, wait: Pace) -> None:
        """From now on, ask ``wait`` between steps (see ``Pace``)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def dead(self) -> EngineDead | None:
        """Why the engine can serve nothing more, where that is known without a request
        (its process exited while idle), else None: the worker then exits before it
        starts another turn on it."""
        ...

    def running(self) -> int: ...

    def kv_cache_usage(self) -> float | None: ...

    def close(self) -> None: ...


# What a worker runs before it takes any prompt (``warm_up``): a few turns at once, of a
# few lengths, so that the engine's first batches (kernels compiled or loaded, caches
# allocated) are not some client's. vLLM on the CPU took 26 s over the first four
# turns a benchmark sent right after start-up, and 140 ms a turn after.
WARM_UP_TURNS = 4
WARM_UP_TOKENS = 4


async def warm_up(engine: Engine) -> None:
    """Run ``WARM_UP_TURNS`` short turns through ``engine`` together, and wait for them."""

    async def turn(i: int) -> None:
        # How many tokens a word takes is the tokenizer's: a turn the model's context
        # cannot hold is halved until it can (the longest then still fills most of it).
        words = min(8 * 4**i, engine.max_model_len // 4)
        while True:
            request = EngineRequest(
                f"warm-up-{i}-{words}",
                (ChatMessage(role="user", content=" ".join(["warm"] * words)),),
                SamplingParams(max_tokens=WARM_UP_TOKENS, ignore_eos=True))
            try:
                await engine.run(request, lambda *_: None)
                return
            except EngineRejected as exc:
                if exc.code != "context_length_exceeded" or words <= 8:
                    raise
                words //= 2

    await asyncio.gather(*(turn(i) for i in range(WARM_UP_TURNS)))


async def outputs(engine: Engine, request: EngineRequest) -> AsyncIterator[EngineOutput]:
    """``request``'s outputs on ``engine``, one by one (a task and a queue: for a caller
    that reads a few requests, not for the worker's turns)."""
    queue: asyncio.Queue[EngineOutput | None] = asyncio.Queue()

    def sink(text: str, token_ids: tuple[int, ...], prompt_tokens: int,
             finish_reason: str | None) -> None:
        queue.put_nowait(EngineOutput(text, token_ids, prompt_tokens, finish_reason))

    running = asyncio.ensure_future(engine.run(request, sink))
    running.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (out := await queue.get()) is not None:
            yield out
        running.result()  # what the engine raised
    finally:
        if not running.done():
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
