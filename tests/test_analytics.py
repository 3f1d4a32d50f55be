"""``pipeline analytics`` (faust-streaming) on a real broker and database, fed by the
whole pipeline on the SIMULATED engine: its tables equal what the log says, and equal a
rebuild from the start of the log into empty tables, after the analytics consumer, the
projector and a worker were SIGKILLed mid-load. Then ``GET /v1/usage``, ``pipeline
usage``, dead letters, aborted transactions, tenants, and the dashboard's metric names."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from infra.process import free_port
from pipeline.codec import CLEAR, conversation_key, key_of
from pipeline.partitioning import partition_for
from pipeline.topics import DEADLETTER, GENERATIONS, PROMPTS
from projections.analytics import AnalyticsMetrics, AnalyticsStore
from projections.migrate import in_schema, migrate
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    Usage,
)
from tests.conftest import (
    PARTITIONS,
    REPO_ROOT,
    Pipeline,
    Service,
    Stack,
    idempotent_conversation,
    new_database,
    start_service,
    wait_healthy,
)
from tests.logread import read_events, read_records
from tests.sse import scrape, stream_chat

RATE = 200  # simulated tokens/s per sequence
TABLES = {
    "analytics_minutes": "tenant, minute, model",
    "analytics_failures": "tenant, minute, model, code",
    "analytics_latency": "tenant, minute, model, metric, bin",
    "analytics_sessions": "tenant, minute, model, conversation_id",
    "analytics_turns": "request_id",
}


@dataclass
class Analytics(Pipeline):
    metrics: dict[str, str] = field(default_factory=dict)  # component -> /metrics URL

    def start_analytics(self, name: str = "analytics", *args: str, **env: str) -> Service:
        port = free_port()
        service = start_service(self.stack, name, "analytics", "--metrics-port", str(port),
                                *args, ANALYTICS_SESSION_TIMEOUT_S="6", **env)
        self.services[name] = service
        self.metrics[name] = f"http://127.0.0.1:{port}/metrics"
        return service

    def start_projector(self) -> Service:
        port = free_port()
        service = start_service(self.stack, "an-projector", "projector", "--metrics-port",
                                str(port))
        self.services["projector"] = service
        self.metrics["projector"] = f"http://127.0.0.1:{port}/metrics"
        return service

    def start_worker(self, name: str) -> Service:
        port = free_port()
        service = start_service(self.stack, name, "worker", "--engine", "sim",
                                "--max-num-seqs", "16", "--metrics-port", str(port),
                                WORKER_SIM_TOKENS_PER_S=str(RATE),
                                WORKER_SESSION_TIMEOUT_MS="6000")
        self.services[name] = service
        self.metrics[name] = f"http://127.0.0.1:{port}/metrics"
        return service


@pytest.fixture(scope="module")
def an(sim_stack: Stack) -> Iterator[Analytics]:
    # A database of its own: the tenant test creates API keys, which turn keys on for
    # every gateway on that database (the other modules' on the shared one included).
    database_url = new_database(sim_stack.database_url, "analytics")
    migrate(database_url)
    stack = Stack(sim_stack.bootstrap, database_url, sim_stack.logs)
    port = free_port()
    p = Analytics(stack, f"http://127.0.0.1:{port}", {})
    try:
        p.start_projector()
        p.services["gateway"] = start_service(
            stack, "an-gateway", "gateway", "--port", str(port),
            GATEWAY_MODELS="sim", GATEWAY_CANCEL_GRACE_S="1")
        p.metrics["gateway"] = f"{p.url}/metrics"
        p.start_worker("an-worker-a")
        p.start_worker("an-worker-b")
        # Offsets not committed on a timer before the first test kills it: what it has
        # applied by then is sure to be delivered again.
        p.start_analytics(ANALYTICS_COMMIT_INTERVAL_S="3600")
        wait_healthy(p.url, list(p.services.values()), timeout=60)
        first = stream_chat(p.url, chat("warm", 2))
        assert first.done, p.logs()
        yield p
    finally:
        for service in p.services.values():
            service.stop()


def chat(content: str, tokens: int, model: str = "sim") -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens,
            "messages": [{"role": "user", "content": content}]}


def keys_in_every_partition() -> list[str]:
    """Idempotency keys whose new conversations fall one in each partition."""
    found: dict[int, str] = {}
    while len(found) < PARTITIONS:
        key = uuid.uuid4().hex
        conversation = idempotent_conversation(key)
        found.setdefault(partition_for(conversation_key(conversation), PARTITIONS), key)
    return list(found.values())


def long_turn(url: str, key: str, started: threading.Barrier) -> str:
    """A 3-second turn; meets ``started`` once its first tokens arrived."""
    body = {**chat(f"long {key}", 3 * RATE), "stream": True}
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{url}/v1/chat/completions", json=body,
            headers={"Idempotency-Key": key}) as resp:
        chunks, done = 0, False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and '"content":"t' in line:
                chunks += 1
                if chunks == 3:
                    started.wait(timeout=30)
    return "finished" if done else f"{resp.status_code} without [DONE]"


def one_turn(url: str, i: int) -> str:
    """Turn ``i`` of the load: mostly finished, every 9th cancelled (the client leaves),
    every 13th failed (past the context). Returns what the client saw."""
    if i % 13 == 0:
        # Past the model's context (the simulated engine's 8,192 tokens): the worker fails
        # the turn, and the client gets a 400 naming why.
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(f"f{i}", 9000), timeout=60)
        failed = r.status_code == 400 and \
            r.json()["error"]["code"] == "context_length_exceeded"
        return "failed" if failed else f"{r.status_code} {r.text}"
    if i % 9 == 0:
        stream_chat(url, chat(f"c{i}", 2000), stop_after=2)
        return "left"
    got = stream_chat(url, chat(f"t{i}", 5 + i % 40))
    return "finished" if got.done else f"error {got.error}"


def run_load(url: str, turns: int, during: list[tuple[float, Any]]) -> list[str]:
    """``turns`` turns, 8 at a time, while each ``(after_s, action)`` runs on time."""
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one_turn, url, i) for i in range(turns)]
        started = time.monotonic()
        for after_s, action in during:
            time.sleep(max(after_s - (time.monotonic() - started), 0))
            action()
        return [f.result() for f in futures]


# -- what the log says, computed here independently of projections.analytics -----
def expected_from_log(bootstrap: str) -> dict[tuple[str, str], Counter[str]]:
    """Per (tenant, model): turns started, finished, cancelled, failed; tokens. Events the
    tables cannot hold (a NUL in a text they key on, a count past a 32-bit column, as
    earlier modules write into these topics on purpose) are dead-lettered, so not here."""
    def holds(*texts: str) -> bool:
        return all("\x00" not in t for t in texts)

    prompts: dict[str, tuple[str, str]] = {}  # a turn's tenant and model: its prompt's
    for _, e in read_events(bootstrap, PROMPTS):
        if isinstance(e, PromptSubmitted) and e.request_id not in prompts \
                and holds(e.request_id, e.tenant, e.model):
            prompts[e.request_id] = (e.tenant, e.model)
    out: dict[tuple[str, str], Counter[str]] = {}
    started: set[str] = set()
    ended: set[str] = set()
    for _, e in read_events(bootstrap, GENERATIONS):
        rid = e.request_id
        if isinstance(e, GenerationStarted) and rid not in started \
                and holds(rid, e.tenant, e.model):
            started.add(rid)
            out.setdefault((e.tenant, e.model), Counter())["started"] += 1
        elif isinstance(e, GenerationFinished) and rid not in ended and holds(rid) \
                and max(e.usage.prompt_tokens, e.usage.completion_tokens) < 2**31:
            ended.add(rid)
            if rid in prompts:
                c = out.setdefault(prompts[rid], Counter())
                c["cancelled" if e.finish_reason == "abort" else "finished"] += 1
                c["prompt_tokens"] += e.usage.prompt_tokens
                c["completion_tokens"] += e.usage.completion_tokens
        elif isinstance(e, GenerationFailed) and rid not in ended and holds(rid, e.code):
            ended.add(rid)
            if rid in prompts:
                out.setdefault(prompts[rid], Counter())["failed"] += 1
    return {k: +c for k, c in out.items() if +c}


def totals(database_url: str) -> dict[tuple[str, str], Counter[str]]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT tenant, model, sum(started), sum(finished), sum(cancelled), sum(failed),"
            " sum(prompt_tokens), sum(completion_tokens) FROM analytics_minutes"
            " GROUP BY 1, 2").fetchall()
    names = ("started", "finished", "cancelled", "failed", "prompt_tokens", "completion_tokens")
    return {(t, m): +Counter(dict(zip(names, map(int, vals), strict=True)))
            for t, m, *vals in rows}


def dump(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(database_url) as conn:
        return {table: conn.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()
                for table, order in TABLES.items()}


def wait_equal(what: str, get: Any, want: Any, timeout: float = 90) -> None:
    """Until ``get()`` equals ``want`` (or ``want()``, read anew each time: the log may
    still grow, a turn whose client left ending after its grace)."""
    deadline = time.monotonic() + timeout
    while True:
        expected = want() if callable(want) else want
        got = get()
        if got == expected:
            return
        assert time.monotonic() < deadline, f"{what}: {got} != {expected}"
        time.sleep(0.5)


def rebuild(an: Analytics) -> str:
    """A second analytics consumer, in a group of its own, from the start of the log into
    an empty schema; its database URL once it has caught up with the live tables."""
    schema = f"rebuild_{uuid.uuid4().hex[:8]}"
    name = f"analytics-{schema}"
    service = an.start_analytics(name, "--group", schema, "--schema", schema)
    url = in_schema(an.stack.database_url, schema)
    try:
        wait_equal("the rebuild", lambda: _safe_dump(url),
                   lambda: dump(an.stack.database_url))
    finally:
        service.stop()
        del an.services[name], an.metrics[name]
    return url


def _safe_dump(url: str) -> dict[str, list[tuple[Any, ...]]] | None:
    try:
        return dump(url)
    except psycopg.errors.UndefinedTable:
        return None  # not migrated yet


def caught_up(an: Analytics) -> None:
    """Until the live tables say what the log says."""
    wait_equal("the live tables", lambda: totals(an.stack.database_url),
               lambda: expected_from_log(an.stack.bootstrap))


# -- the tests ---------------------------------------------------------------------
def batches_applied(an: Analytics) -> float:
    """Batches the analytics consumer has applied (0 while it is still starting: faust
    serves its metrics only once it is up)."""
    try:
        return scrape(an.metrics["analytics"]).get("analytics_batch_seconds_count", 0)
    except httpx.HTTPError:
        return 0


def test_sigkilled_analytics_consumer_equals_a_rebuild(an: Analytics) -> None:
    before = batches_applied(an)

    def kill_and_restart() -> None:
        # Killed once it has applied some of the load (a slow start under a loaded host
        # had it killed before it applied any, and nothing came again).
        wait_equal("batches applied", lambda: batches_applied(an) >= before + 3, True, 60)
        an.services["analytics"].kill()
        time.sleep(2)
        an.start_analytics(ANALYTICS_COMMIT_INTERVAL_S="30")

    outcomes = run_load(an.url, 120, [(4.0, kill_and_restart)])
    seen = Counter(outcomes)
    assert set(seen) <= {"finished", "left", "failed"}, seen
    caught_up(an)
    # What the killed consumer had applied and not committed came again, and added nothing.
    assert scrape(an.metrics["analytics"]).get("analytics_repeated_events_total", 0) > 0
    live = totals(an.stack.database_url)
    sim = live[("default", "sim")]
    assert sim["finished"] >= seen["finished"] and sim["cancelled"] >= 1
    assert sim["failed"] >= seen["failed"] >= 1
    rebuild(an)


def test_exact_after_projector_and_worker_sigkilled(an: Analytics) -> None:
    """A worker killed mid-turn (its turns resumed by the other: attempt 1, one turn each
    in the figures) and the projector killed too; then the analytics consumer, restarted
    beside a second one in its group (the partitions are shared mid-load)."""
    pool = ThreadPoolExecutor(PARTITIONS)
    long: list[Any] = []

    def kill_worker_and_projector() -> None:
        # A turn running in every partition when the worker dies: whichever partitions
        # it had, at least one turn is taken over mid-generation (attempt 1).
        started = threading.Barrier(PARTITIONS + 1)
        long.extend(pool.submit(long_turn, an.url, key, started)
                    for key in keys_in_every_partition())
        started.wait(timeout=30)
        an.services["an-worker-a"].kill()
        an.services["projector"].kill()
        an.start_projector()

    def restart_worker_kill_analytics() -> None:
        an.start_worker("an-worker-a")
        an.services["analytics"].kill()
        an.start_analytics(ANALYTICS_COMMIT_INTERVAL_S="30")
        # and a second consumer in the group: partitions move between the two mid-load
        an.start_analytics("analytics-2", ANALYTICS_COMMIT_INTERVAL_S="30")

    try:
        outcomes = run_load(an.url, 100, [(3.0, kill_worker_and_projector),
                                          (9.0, restart_worker_kill_analytics)])
        outcomes += [f.result() for f in long]
        assert set(outcomes) <= {"finished", "left", "failed"}, Counter(outcomes)
        caught_up(an)
    finally:
        pool.shutdown()
        if "analytics-2" in an.services:
            an.services.pop("analytics-2").stop()
            del an.metrics["analytics-2"]
    resumed = {e.request_id for _, e in read_events(an.stack.bootstrap, GENERATIONS)
               if isinstance(e, GenerationStarted) and e.attempt >= 1}
    caught_up(an)
    url = rebuild(an)
    with psycopg.connect(url) as conn:
        counted = conn.execute("SELECT count(*) FROM analytics_turns WHERE request_id = ANY(%s)"
                               " AND counted", (list(resumed),)).fetchone()
    assert resumed and counted is not None and counted[0] == len(resumed)


def test_aborted_transactions_and_poison_records(an: Analytics) -> None:
    """Read committed: a turn written in an aborted transaction is never counted. A
    record that does not decode, and events the tables cannot hold (a count past its
    column, a NUL), go to the dead-letter topic with the reason, and counting goes on."""
    conv = uuid.uuid4()
    ghost, real = f"ghost-{uuid.uuid4().hex}", f"real-{uuid.uuid4().hex}"

    def turn(rid: str) -> list[Any]:
        ids = {"conversation_id": conv, "request_id": rid, "tenant": "txn"}
        # A model no worker serves: the workers end the turn without starting it, after
        # the end written here (the first end is the one counted).
        return [(PROMPTS, PromptSubmitted(**ids, model="txn-model", messages=(
                    ChatMessage(role="user", content="x"),))),
                (GENERATIONS, GenerationFinished(**ids, model="txn-model", reply_seq=1,
                                                 finish_reason="stop", text="", deltas=0,
                                                 usage=Usage(prompt_tokens=3,
                                                             completion_tokens=0),
                                                 duration_ms=1.0))]

    # Keyed and partitioned as the pipeline writes (a turn's events in one partition of
    # each topic, in order: the order "first" refers to).
    producer = Producer({"bootstrap.servers": an.stack.bootstrap,
                         "partitioner": "murmur2_random",
                         "transactional.id": f"test-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    for rid, commit in ((ghost, False), (real, True)):
        producer.begin_transaction()
        for topic, event in turn(rid):
            producer.produce(topic, key=key_of(event), value=CLEAR.encode(event))
        producer.flush(30)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)
    plain = Producer({"bootstrap.servers": an.stack.bootstrap})
    plain.produce(GENERATIONS, key=b"garbage", value=b'{"type": "TokenDelta", "v"')
    # An event that decodes but that the tables cannot hold: parked too, not a crash
    # loop; and one no event may hold (a NUL in a name: schemas.events), which does not
    # decode (it reached the tables before the rule).
    huge = GenerationFinished(conversation_id=uuid.uuid4(), request_id=f"huge-{uuid.uuid4()}",
                              tenant="txn", model="txn-model", reply_seq=1,
                              finish_reason="stop", text="", deltas=0, duration_ms=1.0,
                              usage=Usage(prompt_tokens=1, completion_tokens=2**40))
    nul = CLEAR.encode(GenerationFailed(
        conversation_id=uuid.uuid4(), request_id=f"nul-{uuid.uuid4()}", tenant="txn",
        code="engine-dead", message="x")).replace(b"engine-dead", b"engine\\u0000dead")
    plain.produce(GENERATIONS, key=key_of(huge), value=CLEAR.encode(huge))
    plain.produce(GENERATIONS, key=b"nul", value=nul)
    plain.flush(30)
    del producer, plain  # (their connections closed now, not at the session's end)
    wait_equal("the committed turn", lambda: totals(an.stack.database_url).get(
        ("txn", "txn-model"), Counter()), Counter(finished=1, prompt_tokens=3))
    with psycopg.connect(an.stack.database_url) as conn:
        assert conn.execute("SELECT request_id FROM analytics_turns WHERE tenant = 'txn'"
                            ).fetchall() == [(real,)]
    garbage = b'{"type": "TokenDelta", "v"'
    wanted = {garbage, CLEAR.encode(huge), nul}

    def parked() -> dict[bytes, str]:
        return {value: h["reason"].decode()
                for _, value, h in read_records(an.stack.bootstrap, DEADLETTER)
                if h.get("consumer") == b"analytics" and value in wanted}

    # Waited for on their own: they may lie in other partitions than the committed turn,
    # which the consumer may read later.
    wait_equal("the three records parked", lambda: set(parked()), wanted)
    reasons = parked()
    assert "not an event" in reasons[garbage]
    assert "the analytics tables refuse it" in reasons[CLEAR.encode(huge)]
    assert "NUL" in reasons[nul], reasons[nul]
    assert scrape(an.metrics["analytics"]).get("analytics_dead_letters_total", 0) >= 3
    assert an.services["analytics"].proc.poll() is None  # still running
    # and still counting: a turn through the pipeline after them is in the tables
    before = totals(an.stack.database_url)[("default", "sim")]["finished"]
    assert stream_chat(an.url, chat("after the poison", 3)).done
    wait_equal("a turn after them", lambda: totals(an.stack.database_url)[
        ("default", "sim")]["finished"], before + 1)


def test_usage_api_and_command(an: Analytics) -> None:
    """``GET /v1/usage`` sums to the tables, by minute, hour and day, grouped by model or
    not, paged; ``pipeline usage`` prints the same; bad parameters are 400s."""
    caught_up(an)
    want = totals(an.stack.database_url)
    now = int(time.time())
    start = now - 3 * 3600

    def summed(params: dict[str, Any]) -> dict[str | None, Counter[str]]:
        out: dict[str | None, Counter[str]] = {}
        page: str | None = None
        while True:
            r = httpx.get(f"{an.url}/v1/usage", params={**params, **(
                {"page": page} if page else {})}, timeout=30)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "page"
            for bucket in body["data"]:
                assert bucket["object"] == "bucket"
                assert bucket["end_time"] > bucket["start_time"]
                for res in bucket["results"]:
                    assert res["object"] == "organization.usage.completions.result"
                    c = out.setdefault(res["model"], Counter())
                    c["input_tokens"] += res["input_tokens"]
                    c["output_tokens"] += res["output_tokens"]
                    c["num_model_requests"] += res["num_model_requests"]
            if not body["has_more"]:
                return out
            page = body["next_page"]

    sim = want[("default", "sim")]
    by_model = summed({"start_time": start, "bucket_width": "1m", "group_by": "model",
                       "limit": 100})
    assert by_model["sim"] == Counter(
        input_tokens=sim["prompt_tokens"], output_tokens=sim["completion_tokens"],
        num_model_requests=sim["finished"] + sim["cancelled"] + sim["failed"])
    everything = sum(want[k]["finished"] + want[k]["cancelled"] + want[k]["failed"]
                     for k in want if k[0] == "default")
    for width in ("1h", "1d"):
        assert summed({"start_time": start, "bucket_width": width})[None][
            "num_model_requests"] == everything
    hour = httpx.get(f"{an.url}/v1/usage", params={"start_time": start, "bucket_width": "1h",
                                                    "group_by": "model"}).json()
    results = [r for b in hour["data"] for r in b["results"] if r["model"] == "sim"]
    assert results and all(r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] for r in results
                           if r["ttft_ms"])
    for bad in ({}, {"start_time": "yesterday"}, {"start_time": start, "bucket_width": "1w"},
                {"start_time": start, "group_by": "user_id"},
                {"start_time": start, "bucket_width": "1m", "limit": 5000},
                {"start_time": now, "end_time": now - 60},
                # Far-off times: a 500 from datetime before (year 11476 is out of range).
                {"start_time": 300000000000, "end_time": 300000000060},
                {"start_time": start, "end_time": 999999999999},
                {"start_time": start, "page": 999999999999}):
        r = httpx.get(f"{an.url}/v1/usage", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"], (bad, r.text)
    out = subprocess.run(
        [sys.executable, "-m", "launch", "usage", "--bucket-width", "1d", "--group-by",
         "model", "--json"], env=an.stack.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    page = json.loads(out.stdout)
    sims = [r for b in page["data"] for r in b["results"] if r["model"] == "sim"]
    assert sum(r["output_tokens"] for r in sims) == sim["completion_tokens"]
    table = subprocess.run([sys.executable, "-m", "launch", "usage", "--bucket-width", "1h"],
                           env=an.stack.env(), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "usage of tenant 'default'" in table.stdout, table.stderr


def test_dashboard_queries_name_metrics_that_exist(an: Analytics) -> None:
    """Every panel of the Grafana dashboard queries metrics some component exports."""
    exported: set[str] = set()
    for url in an.metrics.values():
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("# TYPE "):
                name, kind = line.split()[2:4]
                exported.add(name)
                if kind == "counter":
                    exported.add(name + "_total")
                if kind == "histogram":
                    exported.update(name + s for s in ("_bucket", "_sum", "_count"))
    dashboard = json.loads((REPO_ROOT / "infra" / "grafana" / "chat-pipeline.json").read_text())
    panels = dashboard["panels"]
    assert len(panels) >= 10
    for panel in panels:
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = metric_names(expr)
            assert names and names <= exported, (panel["title"], names - exported)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers once strings, label
    matchers, range durations and grouping clauses are gone, except function calls."""
    expr = re.sub(r'"[^"]*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    return {m.group(1) for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr)
            if not m.group(2) and m.group(1) not in {"and", "or", "unless", "bool", "offset"}}


def test_a_tenant_sees_only_its_usage(an: Analytics, tmp_path: Path) -> None:
    """Last in the module: once a key exists the gateway requires one, and each key's
    tenant sees its own usage only."""
    secrets = {}
    for tenant in ("acme", "globex"):
        out = subprocess.run([sys.executable, "-m", "launch", "keys", "create", "--tenant",
                              tenant], env=an.stack.env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        secrets[tenant] = out.stdout.strip()
    for i in range(3):
        got = stream_chat(an.url, chat(f"acme {i}", 4),
                          headers={"Authorization": f"Bearer {secrets['acme']}"})
        assert got.done, got.error
    wait_equal("acme's turns", lambda: totals(an.stack.database_url).get(
        ("acme", "sim"), Counter())["finished"], 3)

    def requests_of(tenant: str) -> int:
        r = httpx.get(f"{an.url}/v1/usage", params={"start_time": int(time.time()) - 3600,
                                                    "bucket_width": "1h"},
                      headers={"Authorization": f"Bearer {secrets[tenant]}"}, timeout=30)
        assert r.status_code == 200, r.text
        return sum(res["num_model_requests"] for b in r.json()["data"] for res in b["results"])

    assert requests_of("acme") == 3
    assert requests_of("globex") == 0
    assert httpx.get(f"{an.url}/v1/usage", params={"start_time": 0}).status_code == 401


def test_prometheus_holds_a_bounded_number_of_tenants(stack: Stack) -> None:
    """Tenants come from the records, an open set. Past ``ANALYTICS_SERIES_PER_LABEL``
    their turns are counted under tenant "(other)", and the active-sessions gauge names
    the busiest and sums the rest: the registry, and each scrape, stays one size however
    many tenants the log has held, and no count is lost on the way."""
    url = in_schema(stack.database_url, "analytics_capped")
    migrate(stack.database_url, "analytics_capped")
    registry = CollectorRegistry()
    store = AnalyticsStore(url, AnalyticsMetrics(registry, series_per_label=2))
    events: list[Any] = []
    for n in range(6):  # tenant t0 holds 6 sessions, t1 5, ..., t5 1
        for _ in range(6 - n):
            ids = {"conversation_id": uuid.uuid4(), "request_id": uuid.uuid4().hex,
                   "tenant": f"t{n}"}
            events += [PromptSubmitted(**ids, model="m", messages=(
                           ChatMessage(role="user", content="x"),)),
                       GenerationStarted(**ids, model="m", worker="w", reply_seq=1,
                                         prompt_tokens=1)]

    async def apply() -> None:
        try:
            assert await store.apply([(None, event) for event in events]) == []
            await store.refresh_active_sessions()
        finally:
            await store.close()

    asyncio.run(apply())
    started = {s.labels["tenant"]: s.value for m in registry.collect()
               if m.name == "analytics_turns" for s in m.samples
               if s.name == "analytics_turns_total" and s.labels["outcome"] == "started"}
    assert started == {"t0": 6, "t1": 5, "(other)": 4 + 3 + 2 + 1}
    active = {s.labels["tenant"]: s.value for m in registry.collect()
              if m.name == "analytics_active_sessions" for s in m.samples}
    assert active == {"t0": 6, "t1": 5, "(other)": 10}
    assert registry.get_sample_value("analytics_labelled_tenants") == 2


HANGING_STOP = """
import asyncio, sys
import faust
import projections.analytics_app as app
from launch.cli import main

async def never(self, *args, **kwargs):  # a stop that never ends, as one was seen to
    await asyncio.sleep(3600)

app.STOP_GRACE_S = 2.0
faust.App.stop = never
sys.argv = ["pipeline", *sys.argv[1:]]
sys.exit(main())
"""


def test_an_analytics_stop_that_never_ends_is_bounded(sim_stack: Stack) -> None:
    """Stopped by ``make demo`` while it joined its group, the analytics consumer stopped
    no further, until SIGKILLed 40 s later: past ``STOP_GRACE_S`` after the signal it now
    exits, as a SIGKILL would leave it (its folds are idempotent)."""
    schema = f"stop_{uuid.uuid4().hex[:8]}"
    log = sim_stack.logs / f"analytics-{schema}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", HANGING_STOP, "analytics", "--group", schema, "--schema",
             schema, "--metrics-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT, env=sim_stack.env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Starting..." not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert proc.wait(timeout=30) == 1
        assert 2.0 <= time.monotonic() - began < 10
        assert "analytics did not stop within 2 s of the signal: exiting" in log.read_text()
    finally:
        proc.kill()
        proc.wait()
