"""The engine contract the worker drives: vLLM in production, a simulator for load tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
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


class EngineRejected(ValueError):
    """The engine refused the request itself (too long, bad parameters): not retryable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDead(RuntimeError):
    """The engine can no longer serve anything; the worker must exit."""


class Engine(Protocol):
    model_name: str
    max_num_seqs: int
    max_model_len: int
    # The most bytes of text one token stands for (None: not known): what lets a gateway
    # refuse a prompt that cannot fit ``max_model_len`` before it is written.
    max_token_bytes: int | None

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

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
                async for _ in engine.generate(request):
                    pass
                return
            except EngineRejected as exc:
                if exc.code != "context_length_exceeded" or words <= 8:
                    raise
                words //= 2

    await asyncio.gather(*(turn(i) for i in range(WARM_UP_TURNS)))
