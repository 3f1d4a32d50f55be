"""``pipeline bench memory``: what long-term memory adds to a turn's time to first token.

On the local stack: a projector, a vLLM worker and the memory service (both with the
tiny model), and a gateway that recalls from it. One user is given ``memories``
memories first. Then, in rounds, the same question is asked with memory on and off,
alternating, one turn at a time (closed loop, one client): the difference of their
medians is what a recall adds to TTFT. The memory service's own recall time (embedding
the question and the search) is measured alone too.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.serving import _start, _stop
from bench.stack import wait_projected
from infra.process import free_port, wait_http
from workers.tiny_model import TINY_MODEL_NAME

MODEL = TINY_MODEL_NAME
MEMORY_CORE = max(os.cpu_count() or 1, 1) - 1


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> None:
    """A turn, again after Retry-After while the gateway sheds load (a log the local
    stack's earlier runs left waiting drains first)."""
    while True:
        r = client.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code not in (429, 503):
            r.raise_for_status()
            return
        time.sleep(float(r.headers.get("retry-after", "1")))


def _ttft(client: httpx.Client, url: str, user: str, memory: bool) -> float:
    """Seconds from sending the turn to its first SSE message with text."""
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json={
            "model": MODEL, "stream": True, "max_tokens": 2, "memory": memory, "user": user,
            "messages": [{"role": "user", "content": "What do you know about me?"}]}) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
                for _ in lines:  # to its end
                    pass
                return first
    raise RuntimeError("the stream ended without text")


def run(bootstrap: str, log_dir: Path, quick: bool) -> dict[str, Any]:
    exe = [sys.executable, "-m", "launch"]
    port, memory_port = free_port(), free_port()
    memory_url = f"http://127.0.0.1:{memory_port}"
    procs = _start({"worker": [*exe, "worker"]}, log_dir)
    # The embedding engine on a core of its own, apart from the worker's engine (vLLM's
    # CPU backend binds that to the first): sharing one, each stalls the other's steps.
    procs += _start({"memory": [*exe, "memory", "--port", str(memory_port)]}, log_dir,
                    env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(MEMORY_CORE)})
    procs += _start({"projector": [*exe, "projector"],
                     "gateway": [*exe, "gateway", "--port", str(port)]}, log_dir,
                    env={**os.environ, "GATEWAY_MEMORY_URL": memory_url})
    url = f"http://127.0.0.1:{port}"
    memories, rounds = (5, 10) if quick else (20, 40)
    try:
        wait_http(f"{memory_url}/healthz", procs, 900, str(log_dir))
        wait_http(f"{url}/readyz", procs, 900, str(log_dir))
        wait_projected(bootstrap)
        user = f"bench-{uuid.uuid4().hex[:8]}"
        with httpx.Client(timeout=120) as client:
            for i in range(memories):
                _post(client, url, {
                    "model": MODEL, "max_tokens": 1, "memory": True, "user": user,
                    "messages": [{"role": "user", "content": f"Fact {i}: I like {i} things."}]})
            deadline = time.monotonic() + 120
            while len(client.get(f"{url}/v1/memories", params={"user": user}).json()["data"]
                       ) < memories:
                if time.monotonic() > deadline:
                    raise TimeoutError("the memories were not stored in 120 s")
                time.sleep(0.2)
            recall_ms = []
            for _ in range(rounds):
                r = client.post(f"{memory_url}/v1/recall", json={
                    "tenant": "default", "user": user, "text": "What do you know about me?"})
                recall_ms.append(r.json()["ms"])
            on: list[float] = []
            off: list[float] = []
            _ttft(client, url, user, False)  # warm
            for i in range(rounds):
                for memory in ((True, False) if i % 2 == 0 else (False, True)):
                    (on if memory else off).append(_ttft(client, url, user, memory) * 1000)
            seen = {"gateway": _mean_ms(client, f"{url}/metrics",
                                        "gateway_memory_recall_seconds"),
                    "memory": _mean_ms(client, f"{memory_url}/metrics",
                                       "memory_recall_seconds")}
    finally:
        _stop(procs)
    return {"memories": memories, "rounds": rounds, "recall_ms": statistics.median(recall_ms),
            "recall_ms_p90": sorted(recall_ms)[int(0.9 * (len(recall_ms) - 1))],
            "ttft_on_ms": statistics.median(on), "ttft_off_ms": statistics.median(off),
            "added_ms": statistics.median(a - b for a, b in zip(on, off, strict=True)),
            "recall_mean_ms_at_gateway": seen["gateway"],
            "recall_mean_ms_at_memory": seen["memory"], "memory_engine_core": MEMORY_CORE}


def _mean_ms(client: httpx.Client, url: str, histogram: str) -> float:
    """A histogram's mean so far, in ms, from a Prometheus text page."""
    values = {}
    for line in client.get(url).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in (f"{histogram}_sum", f"{histogram}_count"):
            values[name] = float(value)
    count = values.get(f"{histogram}_count", 0.0)
    return values.get(f"{histogram}_sum", 0.0) / count * 1000 if count else float("nan")


def table(f: dict[str, Any]) -> str:
    return "\n".join([
        "| figure | median |", "|---|---:|",
        f"| recall alone (memory service: embed the question, search) | "
        f"{f['recall_ms']:.1f} ms (p90 {f['recall_ms_p90']:.1f}) |",
        f"| TTFT, memory off | {f['ttft_off_ms']:.1f} ms |",
        f"| TTFT, memory on ({f['memories']}+ memories, k=3) | {f['ttft_on_ms']:.1f} ms |",
        f"| added to TTFT (median of paired differences) | {f['added_ms']:.1f} ms |",
        f"| a recall's mean, at the gateway / at the memory service | "
        f"{f['recall_mean_ms_at_gateway']:.1f} / {f['recall_mean_ms_at_memory']:.1f} ms |"])
