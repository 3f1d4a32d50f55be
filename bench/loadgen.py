"""A closed-loop load generator for OpenAI-compatible streaming chat, and the statistics
the benchmarks report. Used against this pipeline and against ``vllm serve`` alike.

Each of ``concurrency`` clients sends streaming requests one after another. A request
records when it was sent, when its first content arrived (TTFT), when it ended, its
output tokens (from the usage chunk) and, if asked, each SSE event id with its arrival
time. Parsing is kept to what is needed, so the generator is not the bottleneck; its
own CPU use is reported with the results.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Request:
    sent: float
    first: float | None = None
    ended: float | None = None
    tokens: int = 0
    error: str | None = None
    arrivals: list[tuple[str, float]] = field(default_factory=list)  # (SSE id, time)
    text: list[str] = field(default_factory=list)  # the content received (with the ids)
    # Gaps between content chunks, as vLLM's benchmark client measures its ITL (only a
    # request made through that client has them).
    chunk_gaps: list[float] = field(default_factory=list)
    # An SSE response's body as read, (time, bytes) per read, parsed after the run
    # (``parse``); None for a request that was not an SSE stream.
    reads: list[tuple[float, bytes]] | None = field(default=None, repr=False)
    keep_ids: bool = False

    def parse(self) -> None:
        """Fill in the timings, tokens, ids and text from the SSE stream's reads (once)."""
        if self.reads is None:
            return
        reads, self.reads = self.reads, None
        for now, message in sse_messages(reads):
            for raw in message.split(b"\n"):
                if raw.startswith(b"data: "):
                    self._data(raw, now)
        if self.ended is None and self.error is None:
            self.error = "no [DONE]"

    def _data(self, raw: bytes, now: float) -> None:
        if self.keep_ids and b'"event_id":"' in raw:
            chunk = json.loads(raw[6:])
            self.arrivals.append((chunk["event_id"], now))
            self.text.extend(choice["delta"].get("content") or "" for choice in chunk["choices"])
        if self.first is None and b'"content":"' in raw and b'"content":""' not in raw:
            self.first = now
        elif b'"usage":{' in raw and b'"choices":[]' in raw:
            self.tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
        elif raw.startswith(b"data: [DONE]"):
            self.ended = now
        elif b'"error":' in raw and b'"error":null' not in raw:
            self.error = json.loads(raw[6:])["error"].get("code", "error")

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itl(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.first is None or self.ended is None or self.tokens < 2:
            return None
        return (self.ended - self.first) / (self.tokens - 1)

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest-rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Summary:
    concurrency: int
    requests: int
    failures: int
    seconds: float
    output_tokens: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]
    client_cpu: float  # the generator's CPU time / wall time (1.0 = one core)
    chunk_itl_ms: dict[str, float]  # over every gap between chunks (vLLM's client's ITL)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.failures) / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s,
                "requests_per_s": self.requests_per_s}


def summarise(concurrency: int, requests: list[Request], seconds: float,
              cpu: float) -> Summary:
    ok = [r for r in requests if r.error is None and r.ended is not None]

    def ms(values: list[float | None], *qs: int) -> dict[str, float]:
        kept = [v * 1000 for v in values if v is not None]
        return {f"p{q}": percentile(kept, q) for q in qs} | {
            "mean": statistics.fmean(kept) if kept else float("nan")}

    return Summary(concurrency, len(requests), len(requests) - len(ok), seconds,
                   sum(r.tokens for r in ok), ms([r.ttft for r in ok], 50, 90, 99),
                   ms([r.itl for r in ok], 50, 99), ms([r.latency for r in ok], 50, 99),
                   cpu / seconds, ms([g for r in ok for g in r.chunk_gaps], 50, 99))


def chat_body(model: str, prompt: str, max_tokens: int, seed: int) -> dict[str, Any]:
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "seed": seed, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}


async def stream_once(client: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      keep_ids: bool = False) -> Request:
    """One streaming chat request, timed. While it streams, each read from the socket is
    only kept with the time it returned; ``Request.parse`` reads the SSE messages out of
    them later (``run_load`` calls it once the timed run is over). Parsing each message as
    it came made the client itself a stage of the pipeline it measured: one process
    reading 256 streams worked through a step's burst of deltas in turn, and the last of
    them waited for the JSON of the others."""
    reads: list[tuple[float, bytes]] = []
    request = Request(time.perf_counter(), reads=reads, keep_ids=keep_ids)
    try:
        async with client.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                request.error = f"HTTP {resp.status}"
                return request
            async for data in resp.content.iter_any():
                reads.append((time.perf_counter(), data))
    except (aiohttp.ClientError, TimeoutError) as exc:
        request.error = type(exc).__name__
    return request


def sse_messages(reads: list[tuple[float, bytes]]) -> Iterator[tuple[float, bytes]]:
    """The SSE messages in ``reads`` (socket reads with the time each returned), each
    with the time of the read that completed it; CRLF line ends are taken as LF."""
    pending = b""
    for at, data in reads:
        pending = (pending + data).replace(b"\r\n", b"\n")
        *whole, pending = pending.split(b"\n\n")
        for message in whole:
            yield at, message


MakeRequest = Callable[[int], Awaitable[Request]]


@dataclass
class Load:
    """The requests of one or more closed-loop runs at one concurrency, with the wall
    time and the generator's CPU time they took."""

    concurrency: int
    requests: list[Request] = field(default_factory=list)
    seconds: float = 0.0
    cpu: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.summary().tokens_per_s

    def add(self, other: Load) -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.cpu += other.cpu

    def summary(self) -> Summary:
        return summarise(self.concurrency, self.requests, self.seconds, self.cpu)


async def run_load(make: MakeRequest, concurrency: int, rounds: int,
                   stagger_s: float = 0.0) -> Load:
    """``concurrency`` clients, each making ``rounds`` requests one after another. With
    ``stagger_s``, client ``i`` starts ``i / concurrency * stagger_s`` late, so that
    long streams do not all begin (and end) in the same instant."""
    results: list[Request] = []

    async def client(i: int) -> None:
        await asyncio.sleep(i / concurrency * stagger_s)
        for k in range(rounds):
            results.append(await make(i * rounds + k))

    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    load = Load(concurrency, results, time.perf_counter() - started, time.process_time() - cpu)
    for request in results:  # after the clock stopped
        request.parse()
    return load


async def closed_loop(make: MakeRequest, concurrency: int, rounds: int,
                      stagger_s: float = 0.0) -> Summary:
    """``run_load``, summarised."""
    return (await run_load(make, concurrency, rounds, stagger_s)).summary()


def http_client(connections: int) -> aiohttp.ClientSession:
    """A client session keeping up to ``connections`` connections alive. aiohttp, for its
    C HTTP parser: with httpx the generator itself capped the load at ~90 requests/s."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600))
