"""``pipeline bench log``: what the log costs in bytes. Each scenario runs against a stack
(SIMULATED worker, projector, gateway) of this code and, with ``--before PATH``, of the
code in that checkout, on the same broker in the same run. For each, the bytes each
topic's log segments grew by on disk (records, batch headers and transaction markers:
what a replica keeps), against the UTF-8 bytes of the text the turns record (the users'
messages and the replies, as the clients received them).

* **replies**: 32 turns of 256 tokens, 32 at once: a typical answer's length.
* **many streams**: 256 turns of 32 tokens at 20 tokens/s, 256 at once: the live
  stream's batching at the concurrency of a loaded GPU.
* **session**: one session of 20 turns, 1 KB messages, 50-token replies.
* **long session**: one session of 25 turns of 40 KB messages (1 MB of history by the
  end), 16-token replies; turns refused are counted.

The durable record is ``chat.prompts``, ``chat.control``, ``chat.generations`` (kept
forever) and ``chat.keys`` (the conversations' data keys, kept until erased); the live
stream is ``chat.live`` (kept 7 days). Code from before the live
stream writes everything to the durable record.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.capacity import _stack
from bench.loadgen import chat_body, http_client, stream_once
from bench.pair import checkout
from pipeline.topics import CONTROL, GENERATIONS, KEYS, LIVE, PROMPTS

DURABLE = (PROMPTS, CONTROL, GENERATIONS, KEYS)
TOPICS = (*DURABLE, LIVE)
WORDS = ("the log is the system of record and every fact about a conversation is an event "
         "on a kafka topic kept for as long as the operator keeps it").split()


@dataclass
class Scenario:
    name: str
    about: str
    # url -> text bytes, tokens, turns, turns refused
    run: Callable[[str], Coroutine[Any, Any, tuple[int, int, int, int]]]
    env: dict[str, str]


def segment_bytes(kafka_home: Path) -> dict[str, int]:
    """The bytes of each topic's log segments, over every node's data directory."""
    sizes = dict.fromkeys(TOPICS, 0)
    for path in kafka_home.glob("**/data/*/*.log"):
        topic = path.parent.name.rsplit("-", 1)[0]
        if topic in sizes:
            sizes[topic] += path.stat().st_size
    return sizes


def _text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    while sum(map(len, out)) + len(out) < chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:chars]


async def _replies(url: str, turns: int, tokens: int, at_once: int) -> tuple[int, int, int, int]:
    async with http_client(at_once) as client:
        semaphore = asyncio.Semaphore(at_once)

        async def one(i: int) -> tuple[int, int, bool]:
            body = chat_body("sim", "hi", tokens, i)
            async with semaphore:
                request = await stream_once(client, url, body, keep_ids=True)
            request.parse()
            return len("hi") + len("".join(request.text).encode()), request.tokens, \
                request.error is None

        done = await asyncio.gather(*(one(i) for i in range(turns)))
    return (sum(t for t, _, _ in done), sum(n for _, n, _ in done), turns,
            sum(not ok for _, _, ok in done))


async def _session(url: str, turns: int, chars: int, tokens: int) -> tuple[int, int, int, int]:
    text = produced = refused = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as client:
        async with client.post(f"{url}/v1/sessions", json={"title": "bench"}) as resp:
            session = (await resp.json())["id"]
        for i in range(turns):
            message = _text(chars, i)
            body = {"content": message, "max_tokens": tokens, "ignore_eos": True,
                    "model": "sim"}
            async with client.post(f"{url}/v1/sessions/{session}/messages", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    refused += 1
                    continue
            reply = answer["choices"][0]["message"]["content"]
            text += len(message.encode()) + len(reply.encode())
            produced += answer["usage"]["completion_tokens"]
    return text, produced, turns, refused


SCENARIOS = (
    Scenario("replies", "32 turns of 256 tokens, 32 at once",
             lambda url: _replies(url, 32, 256, 32), {"WORKER_SIM_TOKENS_PER_S": "100"}),
    Scenario("many streams", "256 turns of 32 tokens at 20 tokens/s, 256 at once",
             lambda url: _replies(url, 256, 32, 256), {"WORKER_SIM_TOKENS_PER_S": "20"}),
    Scenario("session", "one session: 20 turns, 1 KB messages, 50-token replies",
             lambda url: _session(url, 20, 1000, 50), {"WORKER_SIM_TOKENS_PER_S": "200"}),
    Scenario("long session", "one session: 25 turns of 40 KB messages, 16-token replies",
             lambda url: _session(url, 25, 40_000, 16),
             {"WORKER_SIM_TOKENS_PER_S": "200", "WORKER_MAX_MODEL_LEN": "1000000"}),
)


@dataclass(frozen=True)
class Side:
    name: str
    tree: Path | None = None  # None: this checkout
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.env)
        code = checkout(self.tree or Path.cwd())
        commit, _, changed = code.partition(" with changes to ")
        if changed:
            code = f"{commit} with {len(changed.split(', '))} files changed"
        return code + (f", {settings}" if settings else "")


def measure(bootstrap: str, kafka_home: Path, log_dir: Path, scenario: Scenario,
            side: Side) -> dict[str, Any]:
    env = {**scenario.env, **dict(side.env)}
    with _stack(bootstrap, log_dir, env, max_num_seqs=256, tree=side.tree) as (url, _, _):
        before = segment_bytes(kafka_home)
        started = time.monotonic()
        text, tokens, turns, refused = asyncio.run(scenario.run(url))
        seconds = time.monotonic() - started
        time.sleep(1.0)  # the last transactions' markers
        after = segment_bytes(kafka_home)
    grown = {t: after[t] - before[t] for t in TOPICS}
    durable = sum(grown[t] for t in DURABLE)
    return {"topics": grown, "durable_bytes": durable, "live_bytes": grown[LIVE],
            "text_bytes": text, "tokens": tokens, "turns": turns, "refused": refused,
            "seconds": seconds,
            "durable_over_text": durable / text if text else float("nan"),
            "durable_per_token": durable / tokens if tokens else float("nan"),
            "live_per_token": grown[LIVE] / tokens if tokens else float("nan"),
            "text_per_token": text / tokens if tokens else float("nan")}


def run(bootstrap: str, kafka_home: Path, log_dir: Path, before: Path | None,
        scenarios: tuple[Scenario, ...] = SCENARIOS) -> dict[str, Any]:
    sides = [Side("now"), Side("now, uncompressed", env=(("PIPELINE_COMPRESSION", "none"),)),
             *([Side("before", before)] if before is not None else [])]
    results: dict[str, dict[str, Any]] = {}
    for i, scenario in enumerate(scenarios, 1):
        for side in sides:
            print(f"[{i}/{len(scenarios)}] {scenario.name} ({scenario.about}), "
                  f"{side.name} ...", flush=True)
            figures = measure(bootstrap, kafka_home, log_dir, scenario, side)
            results.setdefault(scenario.name, {})[side.name] = figures
            print(f"      durable {figures['durable_bytes']:,} bytes "
                  f"({figures['durable_over_text']:.2f}x the text), live "
                  f"{figures['live_per_token']:.1f} bytes per token; {figures['turns']} turns, "
                  f"{figures['refused']} refused, {figures['seconds']:.0f} s", flush=True)
    return {"scenarios": {s.name: s.about for s in scenarios}, "results": results,
            "sides": {side.name: side.describe() for side in sides}}


def tables(figures: dict[str, Any]) -> str:
    sides = list(figures["sides"])
    out = ["| scenario | code | text bytes | durable bytes | durable / text | durable bytes "
           "per token | live bytes per token | turns refused |",
           "|---|---|---|---|---|---|---|---|"]
    for name, about in figures["scenarios"].items():
        for side in sides:
            f = figures["results"][name][side]
            out.append(f"| {name}: {about} | {side} ({figures['sides'][side]}) | "
                       f"{f['text_bytes']:,} | {f['durable_bytes']:,} | "
                       f"{f['durable_over_text']:.2f}x | {f['durable_per_token']:.1f} | "
                       f"{f['live_per_token']:.1f} | {f['refused']} of {f['turns']} |")
    out += ["", "Bytes per topic:", "",
            "| scenario | code | " + " | ".join(TOPICS) + " |",
            "|---|---|" + "---|" * len(TOPICS)]
    for name in figures["scenarios"]:
        for side in sides:
            grown = figures["results"][name][side]["topics"]
            out.append(f"| {name} | {side} | " + " | ".join(f"{grown[t]:,}" for t in TOPICS)
                       + " |")
    return "\n".join(out)
