"""Several models at once, on the SIMULATED engine: a worker group per model, every
prompt reaching its model's workers, none failed for being another model's; unknown
models refused at once (404), known ones without a live worker refused for now (503),
configured ones waiting in the log for their workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from infra.process import free_port
from pipeline.topics import GENERATIONS
from schemas import GenerationFailed, GenerationStarted
from tests.conftest import Pipeline, Service, Stack, start_service, wait_healthy
from tests.logread import read_events
from tests.sse import scrape, stream_chat
from workers.sim_engine import sim_token_text

CONFIGURED = ("sim-a", "sim-b")


class Models(Pipeline):
    workers: dict[str, Service]

    def start_worker(self, model: str) -> Service:
        metrics = free_port()
        service = start_service(self.stack, f"worker-{model}", "worker", "--engine", "sim",
                                "--served-model-name", model, "--max-num-seqs", "16",
                                "--metrics-port", str(metrics),
                                WORKER_SIM_TOKENS_PER_S="100", WORKER_SESSION_TIMEOUT_MS="6000")
        self.workers[model] = service
        self.services[f"worker-{model}"] = service
        wait_for(lambda: _assigned(f"http://127.0.0.1:{metrics}/metrics"), 60,
                 f"the {model} worker to own partitions")
        return service

    def models(self) -> set[str]:
        body = httpx.get(f"{self.url}/v1/models", timeout=10).json()
        return {m["id"] for m in body["data"]}


@pytest.fixture(scope="module")
def models(sim_stack: Stack) -> Iterator[Models]:
    port = free_port()
    p = Models(sim_stack, f"http://127.0.0.1:{port}", {})
    p.workers = {}
    try:
        p.services["projector"] = start_service(sim_stack, "models-projector", "projector")
        p.services["gateway"] = start_service(
            sim_stack, "models-gateway", "gateway", "--port", str(port),
            GATEWAY_MODELS=",".join(CONFIGURED), GATEWAY_CANCEL_GRACE_S="1")
        wait_healthy(p.url, list(p.services.values()), timeout=60)
        for model in CONFIGURED:
            p.start_worker(model)
        wait_for(lambda: set(CONFIGURED) <= p.models(), 30, "both models listed")
        yield p
    finally:
        for service in p.services.values():
            service.stop()


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _assigned(url: str) -> bool:
    try:
        return scrape(url).get("worker_assigned_partitions", 0) > 0
    except httpx.HTTPError:
        return False


def chat(model: str, content: str, tokens: int) -> dict[str, object]:
    return {"model": model, "max_tokens": tokens,
            "messages": [{"role": "user", "content": content}]}


def expected(tokens: int) -> str:
    return "".join(sim_token_text(i) for i in range(tokens))


def test_two_models_side_by_side_with_no_failed_turn(models: Models) -> None:
    """40 concurrent turns, half for each model: each runs on its own model's worker and
    finishes; no turn fails for being another model's."""
    asked = {f"turn {i}": CONFIGURED[i % 2] for i in range(40)}
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda item: stream_chat(
            models.url, chat(item[1], item[0], 8 + len(item[0]) % 5)), asked.items()))
    assert all(r.done and r.error is None for r in results), [r.error for r in results]
    assert all(r.text == expected(8 + len(c) % 5) for r, c in zip(results, asked, strict=True))
    ours = {r.request_id: asked[c] for r, c in zip(results, asked, strict=True)}
    pids = {m: s.proc.pid for m, s in models.workers.items()}
    events = [e for _, e in read_events(models.stack.bootstrap, GENERATIONS)
              if e.request_id in ours]
    started = {e.request_id: e for e in events if isinstance(e, GenerationStarted)}
    assert set(started) == set(ours)
    for rid, event in started.items():
        assert event.model == ours[rid]
        assert event.worker.endswith(f"-{pids[ours[rid]]}")  # its model's worker ran it
    assert not [e for e in events if isinstance(e, GenerationFailed)]
    assert {r.chunks[0]["model"] for r in results if r.chunks} == set(CONFIGURED)


def test_unknown_model_is_404_at_once(models: Models) -> None:
    sent = time.monotonic()
    r = httpx.post(f"{models.url}/v1/chat/completions", json=chat("no-such-model", "x", 2),
                   timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert time.monotonic() - sent < 2


def test_known_model_without_a_live_worker_is_503_and_a_configured_one_waits(
        models: Models) -> None:
    """A model served a moment ago and not configured: 503 with Retry-After once its
    last worker stopped. A configured model whose worker is down: the turn waits in the
    log and runs when a worker comes."""
    extra = models.start_worker("sim-c")
    wait_for(lambda: "sim-c" in models.models(), 30, "sim-c listed")
    assert stream_chat(models.url, chat("sim-c", "hello", 3)).text == expected(3)
    extra.stop()  # its heartbeat's tombstone takes it off the roster at once
    wait_for(lambda: "sim-c" not in models.models(), 30, "sim-c gone from /v1/models")
    r = httpx.post(f"{models.url}/v1/chat/completions", json=chat("sim-c", "x", 2), timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_unavailable" and r.headers["retry-after"]

    models.workers["sim-b"].stop()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(stream_chat, models.url, chat("sim-b", "queued", 4))
        time.sleep(3)
        assert not waiting.done()  # accepted, waiting in the log for a sim-b worker
        models.start_worker("sim-b")
        got = waiting.result(timeout=120)
    assert got.done and got.text == expected(4)
