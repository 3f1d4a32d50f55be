"""Models and rollouts, on the SIMULATED engine: a worker group per model, every
prompt reaching its model's workers, none failed for being another model's; unknown
models refused at once (404), known ones without a live worker refused for now (503),
configured ones waiting in the log for their workers; ``pipeline rollout`` promoting a
healthy version and rolling back a slow one (fault injection: a 3 s TTFT) with no
client error, every routing decision in the log."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from infra.process import free_port
from pipeline.rollout import publish
from pipeline.topics import GENERATIONS, PROMPTS
from schemas import GenerationFailed, GenerationFinished, GenerationStarted, PromptSubmitted
from schemas.rollout import Rollout
from tests.conftest import Pipeline, Service, Stack, start_service, wait_healthy
from tests.logread import read_events
from tests.sse import Streamed, scrape, stream_chat
from workers.sim_engine import sim_token_text

CONFIGURED = ("sim-a", "sim-b")


class Models(Pipeline):
    workers: dict[str, Service]

    def start_worker(self, model: str, **env: str) -> Service:
        metrics = free_port()
        service = start_service(self.stack, f"worker-{model}", "worker", "--engine", "sim",
                                "--served-model-name", model, "--max-num-seqs", "16",
                                "--metrics-port", str(metrics),
                                **{"WORKER_SIM_TOKENS_PER_S": "100",
                                   "WORKER_SESSION_TIMEOUT_MS": "6000", **env})
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


# -- rollouts -------------------------------------------------------------------------
def rollout(models: Models, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "launch", "rollout", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=models.stack.env())


def under_load(models: Models, alias: str, command: subprocess.Popen[str],
               ) -> tuple[str, list[Streamed]]:
    """New conversations asking for ``alias``, 6 at a time, until ``command`` ends."""
    results: list[Streamed] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        i = 0
        while command.poll() is None:
            got = stream_chat(models.url, chat(alias, f"load {n}-{i}", 4))
            with lock:
                results.append(got)
            i += 1

    with ThreadPoolExecutor(6) as pool:
        for n in range(6):
            pool.submit(client, n)
        out, _ = command.communicate(timeout=300)
    return out, results


def routed(models: Models, results: list[Streamed]) -> dict[str, PromptSubmitted]:
    ours = {r.request_id for r in results}
    return {e.request_id: e for _, e in read_events(models.stack.bootstrap, PROMPTS)
            if isinstance(e, PromptSubmitted) and e.request_id in ours}


def served_by(models: Models, request_ids: set[str]) -> dict[str, str]:
    return {e.request_id: e.model for _, e in read_events(models.stack.bootstrap, GENERATIONS)
            if isinstance(e, GenerationFinished) and e.request_id in request_ids}


def status(models: Models, alias: str) -> str:
    done = subprocess.run([sys.executable, "-m", "launch", "rollout", "status", alias],
                          capture_output=True, text=True, env=models.stack.env(), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_rollout_to_a_version_without_workers_is_refused(models: Models) -> None:
    command = rollout(models, "sim-a", "--to", "sim-nowhere")
    out, _ = command.communicate(timeout=60)
    assert command.returncode == 2, out
    assert "no live worker serves sim-nowhere" in out


def test_a_healthy_version_is_promoted_with_no_client_error(models: Models) -> None:
    """Half the new conversations of alias sim-a go to sim-a2 until 10 of its turns
    ended; as healthy as sim-a, it is promoted, and new turns go to it. Every turn under
    way finished on the version that accepted it."""
    models.start_worker("sim-a2")
    command = rollout(models, "sim-a", "--to", "sim-a2", "--share", "0.5", "--turns", "10",
                      "--ttft-slack-ms", "500")
    out, results = under_load(models, "sim-a", command)
    assert command.returncode == 0, out
    assert "promoted sim-a2" in out and "/10 turns" in out  # its progress lines
    assert results and all(r.done and r.error is None and r.text == expected(4)
                           for r in results), [r.error for r in results if r.error]
    prompts = routed(models, results)
    assert set(prompts) == {r.request_id for r in results}
    # Turns accepted before the gateway read the rollout's record went by the name.
    split = [p for p in prompts.values() if p.rollout is not None]
    assert all(p.model == "sim-a" for p in prompts.values() if p.rollout is None)
    assert {p.alias for p in split} == {"sim-a"} and len({p.rollout for p in split}) == 1
    assert {p.model for p in split} == {"sim-a", "sim-a2"}
    # Which version served which turn: the one its routing decision named.
    assert served_by(models, set(prompts)) == {rid: p.model for rid, p in prompts.items()}
    text = status(models, "sim-a")
    assert "sim-a: promoted, serving sim-a2" in text
    assert re.search(r"sim-a2: (\d+) turns, 0 failed", text), text
    wait_for(lambda: _version_of(models, "sim-a") == "sim-a2", 30, "new turns on sim-a2")


def test_a_slow_version_is_rolled_back_with_no_client_error(models: Models) -> None:
    """sim-a3 answers its first token after 3 s (fault injection): its health check
    fails on TTFT p99 and it is rolled back. Its clients still got whole answers, from
    sim-a3, and new turns go back to sim-a2."""
    models.start_worker("sim-a3", WORKER_SIM_TTFT_MS="3000")
    command = rollout(models, "sim-a", "--to", "sim-a3", "--share", "0.5", "--turns", "6")
    out, results = under_load(models, "sim-a", command)
    assert command.returncode == 1, out
    assert "rolled back to sim-a2" in out and "TTFT p99" in out
    assert results and all(r.done and r.error is None and r.text == expected(4)
                           for r in results), [r.error for r in results if r.error]
    prompts = routed(models, results)
    slow = {rid for rid, p in prompts.items() if p.model == "sim-a3"}
    assert len(slow) >= 6
    assert served_by(models, set(prompts)) == {rid: p.model for rid, p in prompts.items()}
    text = status(models, "sim-a")
    assert "sim-a: rolled_back, serving sim-a2" in text and "TTFT p99" in text
    wait_for(lambda: all(_version_of(models, "sim-a") == "sim-a2" for _ in range(5)), 30,
             "new turns back on sim-a2")


def test_a_running_rollout_is_resumed_refused_twice_and_aborted(models: Models) -> None:
    """While a rollout runs, the same command again resumes it, a rollout to another
    version is refused, and ``--abort`` ends it (the watching command sees that)."""
    first = rollout(models, "sim-a", "--to", "sim-a3", "--turns", "1000")
    wait_for(lambda: "running" in status(models, "sim-a"), 30, "the rollout to run")
    again = rollout(models, "sim-a", "--to", "sim-a3", "--turns", "1000")
    other = rollout(models, "sim-a", "--to", "sim-b")
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 2 and "a rollout of sim-a to sim-a3 is running" in out
    abort = rollout(models, "sim-a", "--abort")
    out, _ = abort.communicate(timeout=60)
    assert abort.returncode == 0, out
    for command in (first, again):
        out, _ = command.communicate(timeout=60)
        assert command.returncode == 1 and "ended elsewhere: rolled_back" in out, out
    assert "resuming the rollout of sim-a to sim-a3" in out
    text = status(models, "sim-a")
    assert "sim-a: rolled_back, serving sim-a2" in text and "ended by an operator" in text


def test_a_rollout_superseded_by_another_command_stands_down(models: Models) -> None:
    """Two commands that started a rollout of one alias at once: the one whose record is
    no longer the latest stops watching, without a verdict."""
    first = rollout(models, "sim-a", "--to", "sim-a3", "--turns", "1000")
    wait_for(lambda: "running" in status(models, "sim-a"), 30, "the rollout to run")
    now = time.time()
    rival = Rollout(alias="sim-a", id="rival", stable="sim-a2", candidate="sim-a3",
                    share=0.1, started_at=now, updated_at=now)
    publish(models.stack.bootstrap, rival)
    out, _ = first.communicate(timeout=60)
    assert first.returncode == 1 and "superseded by rollout rival" in out, out
    abort = rollout(models, "sim-a", "--abort")
    out, _ = abort.communicate(timeout=60)
    assert abort.returncode == 0, out
    assert "sim-a: rolled_back, serving sim-a2 (rollout rival" in status(models, "sim-a")


def _version_of(models: Models, alias: str) -> str:
    got = stream_chat(models.url, chat(alias, f"which {uuid.uuid4()}", 2))
    assert got.done and got.error is None
    return str(got.chunks[0]["model"])
