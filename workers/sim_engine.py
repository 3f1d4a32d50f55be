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
(a sequence's first token comes at the first step ``ttft_ms`` after it starts). vLLM
hands the worker a step's outputs together in the same way. (A clock per sequence
would wake the worker once per token instead of once per step, and charge it for
wake-ups no batched engine causes.) Token times are fixed when a sequence starts
running, as a GPU's steps do not wait for the process reading their outputs: a
worker whose event loop runs late receives the tokens due meanwhile at once, and the
sequence still ends on time. (Sleeping a step after each token instead would charge
every delay in the reader's loop to the engine.)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from workers.engine import EngineDead, EngineOutput, EngineRejected, EngineRequest

SIM_VOCAB_BASE = 1000
# How its token times are made, for benchmark reports that set runs side by side.
SIM_CLOCK = "one step clock for all its sequences"


def sim_token_text(index: int) -> str:
    return f"t{index} "


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
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._dead = False

    def running(self) -> int:
        return len(self._running)

    def crash(self) -> None:
        """Fault injection: every generation, running or new, fails as if the GPU died."""
        self._dead = True

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        prompt_tokens = sum(len(m.content.split()) + 4 for m in request.messages)
        wanted = request.sampling.max_tokens or self.default_max_tokens
        if prompt_tokens + wanted > self.max_model_len:
            raise EngineRejected("context_length_exceeded",
                                 f"This model's maximum context length is {self.max_model_len}"
                                 f" tokens; the request needs {prompt_tokens + wanted}.")
        start = len(request.prefix_token_ids)
        if self._dead:
            raise EngineDead("simulated engine crashed")
        self._known.add(request.request_id)
        try:
            async with self._slots:
                self._running.add(request.request_id)
                loop = asyncio.get_running_loop()
                due = math.ceil((loop.time() + self._ttft) / self._step) * self._step
                await asyncio.sleep(max(due - loop.time(), 0.0))
                for index in range(start, wanted):
                    if self._dead:
                        raise EngineDead("simulated engine crashed")
                    if request.request_id in self._aborted:
                        yield EngineOutput("", (), prompt_tokens, finish_reason="abort")
                        return
                    last = index == wanted - 1
                    yield EngineOutput(sim_token_text(index), (SIM_VOCAB_BASE + index,),
                                       prompt_tokens, finish_reason="length" if last else None)
                    if not last:
                        due += self._step
                        await asyncio.sleep(max(due - loop.time(), 0.0))
                if start >= wanted:
                    yield EngineOutput("", (), prompt_tokens, finish_reason="length")
        finally:
            self._known.discard(request.request_id)
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._known:
            self._aborted.add(request_id)

    def kv_cache_usage(self) -> float | None:
        return None

    def close(self) -> None:
        pass
