"""A SIMULATED engine, for load and fault tests on machines without a GPU.

It follows the ``Engine`` protocol with no model at all: after ``ttft_ms`` a
sequence emits one token every ``1 / tokens_per_s`` seconds, and at most
``max_num_seqs`` sequences run at once (the rest wait, as in vLLM's scheduler).
Token ``i`` of every reply is the text ``t{i} ``, so a reader can check a stream
for gaps and duplicates by its text alone. ``crash()`` (SIGUSR1 to a simulated
worker) makes the engine die, as a GPU fault would, for fault tests. Its defaults
resemble a GPU serving a small model: 50 ms to first token, 50 tokens/s per
sequence, 256 sequences.

The sequences share one step clock, as the sequences of a GPU's batch do: every
``1 / tokens_per_s`` seconds, each running sequence gets its next token, all at once
(a sequence's first token comes at the first step ``ttft_ms`` after it starts). One
task runs the clock and hands every sequence's token of a step to its sink, as the
vLLM engine's pump hands a step's outputs (``workers.engine``): the worker wakes once
per step, not once per token. Token times are fixed when a sequence starts running,
as a GPU's steps do not wait for the process reading their outputs: a worker whose
event loop runs late (or that paces the engine, ``Engine.pace``) receives the tokens
due meanwhile at once, and the sequence still ends on time. (Sleeping a step after
each token instead would charge every delay in the reader's loop to the engine.)
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from dataclasses import dataclass

from workers.engine import EngineDead, EngineRejected, EngineRequest, Pace, Sink, unpaced

log = logging.getLogger(__name__)
SIM_VOCAB_BASE = 1000
# How its token times are made, for benchmark reports that set runs side by side.
SIM_CLOCK = "one step clock for all its sequences"
# A step counts as come this early (a fraction of a step): timers fire a little early
# or late, never a whole step.
_EARLY = 0.05


def sim_token_text(index: int) -> str:
    return f"t{index} "


@dataclass(slots=True)
class _Sequence:
    request_id: str
    sink: Sink
    prompt_tokens: int
    index: int  # its next token
    wanted: int
    step: int  # the step its next token is due at
    ended: asyncio.Future[None]


class SimEngine:
    def __init__(
        self,
        model_name: str = "sim",
        *,
        ttft_ms: float = 50.0,
        tokens_per_s: float = 50.0,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        default_max_tokens: int = 64,
    ) -> None:
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # It counts a message's words, of any length, as its tokens: no bound on a token.
        self.max_token_bytes: int | None = None
        self.default_max_tokens = default_max_tokens
        self._ttft = ttft_ms / 1000
        self._step = 1 / tokens_per_s
        self._slots = asyncio.Semaphore(max_num_seqs)
        self._known: set[str] = set()  # waiting or running
        self._running: dict[str, _Sequence] = {}
        self._aborted: set[str] = set()
        self._dead = False
        self._clock: asyncio.Task[None] | None = None
        self._pace: Pace = unpaced

    def running(self) -> int:
        return len(self._running)

    def crash(self) -> None:
        """Fault injection: every generation, running or new, fails as if the GPU died."""
        self._dead = True

    def dead(self) -> EngineDead | None:
        return EngineDead("simulated engine crashed") if self._dead else None

    def pace(self, wait: Pace) -> None:
        self._pace = wait

    async def run(self, request: EngineRequest, sink: Sink) -> None:
        prompt_tokens = sum(len(m.content.split()) + 4 for m in request.messages)
        wanted = request.sampling.max_tokens or self.default_max_tokens
        if prompt_tokens + wanted > self.max_model_len:
            raise EngineRejected("context_length_exceeded",
                                 f"This model's maximum context length is {self.max_model_len}"
                                 f" tokens; the request needs {prompt_tokens + wanted}.")
        if self._dead:
            raise EngineDead("simulated engine crashed", before=True)
        rid = request.request_id
        self._known.add(rid)
        try:
            async with self._slots:
                loop = asyncio.get_running_loop()
                first = math.ceil((loop.time() + self._ttft) / self._step - _EARLY)
                sequence = _Sequence(rid, sink, prompt_tokens, len(request.prefix_token_ids),
                                     wanted, first, loop.create_future())
                self._running[rid] = sequence
                if self._clock is None or self._clock.done():
                    # Its own context: the sinks it calls are every turn's, not this one's.
                    self._clock = asyncio.create_task(self._tick(), name="sim-engine-clock",
                                                      context=contextvars.Context())
                await sequence.ended
        finally:
            self._known.discard(rid)
            self._running.pop(rid, None)
            self._aborted.discard(rid)

    async def _tick(self) -> None:
        """The step clock: at each step, every running sequence's tokens due by then. If
        it fails, every running sequence fails with it (none waits for a step that will
        not come), and the next request starts it again."""
        try:
            await self._steps()
        except Exception as exc:
            log.exception("the simulated engine's step clock failed: its running requests "
                          "fail with it")
            for sequence in list(self._running.values()):
                if not sequence.ended.done():
                    sequence.ended.set_exception(exc)

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running:
            now = math.floor(loop.time() / self._step + _EARLY)
            for sequence in list(self._running.values()):
                if sequence.step <= now and not sequence.ended.done():
                    self._hand(sequence, now)
            wait = self._pace()
            if wait is not None:
                await wait
            await asyncio.sleep(max((now + 1) * self._step - loop.time(), 0.0))

    def _hand(self, sequence: _Sequence, now: int) -> None:
        """The tokens of ``sequence`` due by step ``now``, to its sink."""
        ended = sequence.ended
        try:
            if self._dead:
                raise EngineDead("simulated engine crashed")
            if sequence.request_id in self._aborted:
                sequence.sink("", (), sequence.prompt_tokens, "abort")
            elif sequence.index >= sequence.wanted:  # an earlier attempt emitted them all
                sequence.sink("", (), sequence.prompt_tokens, "length")
            else:
                while sequence.step <= now and sequence.index < sequence.wanted:
                    index = sequence.index
                    sequence.index += 1
                    sequence.step += 1
                    last = sequence.index == sequence.wanted
                    sequence.sink(sim_token_text(index), (SIM_VOCAB_BASE + index,),
                                  sequence.prompt_tokens, "length" if last else None)
                if sequence.index < sequence.wanted:
                    return
            ended.set_result(None)
        except Exception as exc:  # its sink's, or the engine's death: that request's
            ended.set_exception(exc)
        self._running.pop(sequence.request_id, None)

    async def abort(self, request_id: str) -> None:
        if request_id in self._known:
            self._aborted.add(request_id)

    def kv_cache_usage(self) -> float | None:
        return None

    def close(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
