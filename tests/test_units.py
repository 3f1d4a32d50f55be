"""Pure parts, no broker: codec, offset watermarks, projection, request parsing, the
simulated engine, the engine's scheduling priority."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from gateway.auth import Guard
from gateway.errors import APIError
from gateway.openai_api import parse_chat_request
from gateway.usage_query import LATEST, UsageError, UsageQuery
from infra.process import free_port
from launch.cli import service_down
from pipeline.codec import DecodeError, Position, decode, encode
from pipeline.kafka import Record
from pipeline.metrics import LoopWatch, serve_metrics
from pipeline.settings import CommonSettings
from projections.projection import project
from schemas import (
    ChatMessage,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SamplingParams,
    TokenDelta,
    Usage,
    sketch,
)
from schemas.events import new_event_id
from schemas.rollout import (
    Figures,
    Health,
    HealthPolicy,
    Rollout,
    judge,
    newer_rollout,
    route,
    stale,
)
from workers.engine import EngineRequest
from workers.host import AUTOGROUP_SWITCH, lower_session_priority
from workers.offsets import OffsetTracker
from workers.recovery import LogFolder, Recovered, fold, fold_values
from workers.sim_engine import SimEngine, sim_token_text
from workers.takeover import reported

CONV = uuid.uuid4()


def prompt(**kw: object) -> PromptSubmitted:
    fields: dict[str, object] = {
        "conversation_id": CONV, "request_id": "r1", "model": "m",
        "messages": (ChatMessage(role="user", content="hello there"),),
    }
    fields.update(kw)
    return PromptSubmitted(**fields)  # type: ignore[arg-type]


def test_codec_round_trips_every_field() -> None:
    event = prompt(history_len=0)
    assert decode(encode(event)) == event


@pytest.mark.parametrize("data", [None, b"", b"{", b'{"type": "PromptSubmitted"}',
                                  b'{"type": "Nope", "v": 1}', b"\xff\xfe"])
def test_codec_rejects_what_is_not_an_event(data: bytes | None) -> None:
    with pytest.raises(DecodeError):
        decode(data)


def test_event_ids_are_random_version_4_uuids_and_a_forked_child_draws_its_own() -> None:
    ids = [TokenDelta(conversation_id=uuid.uuid4(), request_id="r", seq=0, text="").event_id
           for _ in range(2 * new_event_id.PER_CALL + 1)]
    assert all(i.version == 4 and i.variant == uuid.RFC_4122 for i in ids)
    assert len(set(ids)) == len(ids)
    # The pool a process holds is not its forked child's: the child would repeat its ids.
    script = """if True:
        import os
        from schemas.events import new_event_id
        new_event_id()  # the pool is full now
        read, write = os.pipe()
        if os.fork() == 0:
            os.write(write, new_event_id().bytes)
            os._exit(0)
        os.wait()
        child = os.read(read, 16)
        print(child in {new_event_id().bytes for _ in range(new_event_id.PER_CALL)})
    """
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    assert run.stdout.strip() == "False"


def test_watermark_commits_below_the_oldest_in_flight_offset() -> None:
    t = OffsetTracker()
    tp = ("chat.prompts", 0)
    for offset in (5, 6, 7):
        t.taken(tp, offset)
    t.done(tp, 6)
    assert t.committable() == {tp: 5}  # 5 still in flight: nothing past it is safe
    t.mark_committed({tp: 5})
    assert t.committable() == {}
    t.done(tp, 5)
    assert t.committable() == {tp: 7}
    t.done(tp, 7)
    assert t.committable() == {tp: 8}
    t.forget([tp])
    assert t.committable() == {}


def test_projection_places_messages_by_history_length() -> None:
    event = prompt(
        history=(ChatMessage(role="user", content="a"), ChatMessage(role="assistant", content="b")),
        messages=(ChatMessage(role="user", content="c"),), history_len=2,
    )
    inserts = [w.params for w in project(event) if "INTO messages" in w.sql]
    assert [(p["seq"], p["role"], p["content"]) for p in inserts] == [(2, "user", "c")]
    assert event.reply_seq == 3


def test_projection_stores_the_reply_at_its_seq_and_ignores_deltas() -> None:
    finished = GenerationFinished(
        conversation_id=CONV, request_id="r1", model="m", reply_seq=1, finish_reason="length",
        text="xyz", usage=Usage(prompt_tokens=3, completion_tokens=2), deltas=2, duration_ms=5)
    writes = project(finished)
    message = next(w.params for w in writes if "INTO messages" in w.sql)
    assert (message["seq"], message["role"], message["content"]) == (1, "assistant", "xyz")
    assert project(TokenDelta(conversation_id=CONV, request_id="r1", seq=0, text="x")) == []


def test_projection_titles_a_new_conversation_from_its_first_user_message() -> None:
    conversation = project(prompt())[0]
    assert conversation.params[2] == "hello there"
    assert project(prompt(history=(ChatMessage(role="user", content="x"),),
                          history_len=1))[0].params[2] is None


def test_chat_request_maps_sampling_parameters() -> None:
    req = parse_chat_request(
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_tokens": 9, "temperature": 0.2, "top_p": 0.5,'
        b' "stop": "END", "seed": 3, "stream_options": {"include_usage": true}}')
    assert req.messages[0].to_event() == ChatMessage(role="user", content="ab")
    sampling = req.sampling()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop,
            sampling.seed) == (9, 0.2, 0.5, ("END",), 3)
    assert req.include_usage()


@pytest.mark.parametrize("body", [b"", b"null", b'{"model": "m", "messages": [{"role": "user"}]}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "stop": ["a", "b", "c", "d", "e"]}',
                                  b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                                  b' "logprobs": true}'])
def test_chat_request_errors_are_400s(body: bytes) -> None:
    with pytest.raises(APIError) as err:
        parse_chat_request(body)
    assert err.value.status == 400
    assert err.value.body()["error"]["message"]  # type: ignore[index]


def test_projection_stores_nul_as_a_replacement_character() -> None:
    finished = GenerationFinished(
        conversation_id=CONV, request_id="r1", model="m", reply_seq=1, finish_reason="stop",
        text="a\x00b", usage=Usage(prompt_tokens=1, completion_tokens=1), deltas=1,
        duration_ms=1)
    message = next(w.params for w in project(finished) if "INTO messages" in w.sql)
    assert message["content"] == "a\ufffdb"


def test_recovery_from_raw_records_equals_the_fold_of_every_decoded_event() -> None:
    """The takeover scan decodes only terminal events and unfinished turns' records; it
    must find what decoding everything finds, whatever text the deltas carry."""
    tricky = 'x", "request_id":"done", "type":"GenerationFinished" \\" '

    def turn(rid: str, deltas: int, end: str | None, attempt: int = 0) -> list[object]:
        ids = {"conversation_id": CONV, "request_id": rid}
        events: list[object] = [GenerationStarted(**ids, model="m", worker="w",
                                                  attempt=attempt, reply_seq=1,
                                                  prompt_tokens=3)]
        events += [TokenDelta(**ids, attempt=attempt, seq=i, text=f"{tricky}{i}")
                   for i in range(deltas)]
        if end == "finished":
            events.append(GenerationFinished(
                **ids, model="m", reply_seq=1, finish_reason="stop", text="", deltas=deltas,
                usage=Usage(prompt_tokens=3, completion_tokens=deltas), duration_ms=1))
        elif end == "failed":
            events.append(GenerationFailed(**ids, code="engine_dead", message="x"))
        return events

    events = [*turn("done", 5, "finished"), *turn("open", 3, None),
              *turn("failed", 2, "failed"), *turn("open", 2, None, attempt=1),
              *turn("chatcmpl-\\\"odd", 2, None)]
    values: list[bytes | None] = [encode(e) for e in events]  # type: ignore[arg-type]
    values += [None, b"not json", b'{"request_id":"open","type":"GenerationFinished"}']

    expected = {rid: Recovered(ended=True) if rec.ended else rec
                for rid, rec in fold(events).items()}  # type: ignore[arg-type]
    found = fold_values(values)
    assert found == expected
    assert found["open"].attempt == 1 and [d.seq for d in found["open"].emitted()] == [0, 1, 2]
    assert found["done"].ended and found["failed"].ended and not found["open"].ended


def test_a_takeover_holds_only_the_records_of_turns_not_seen_to_end() -> None:
    """A worker taking over folds a window of ``chat.generations`` as it reads it: the
    records of a turn are dropped, undecoded, once its end is read. Kept whole, the
    window of a busy log took a worker past 10 GB before it served anything."""
    folder = LogFolder()
    for t in range(200):
        ids = {"conversation_id": uuid.uuid4(), "request_id": f"turn-{t}"}
        folder.add(encode(GenerationStarted(**ids, model="m", worker="w", reply_seq=1,
                                            prompt_tokens=3)))
        for i in range(50):
            folder.add(encode(TokenDelta(**ids, seq=i, text=f"t{i} ")))
        if t < 199:
            folder.add(encode(GenerationFinished(
                **ids, model="m", reply_seq=1, finish_reason="stop", text="", deltas=50,
                usage=Usage(prompt_tokens=3, completion_tokens=50), duration_ms=1)))
        assert folder.held == (51 if t == 199 else 0)
    found = folder.result()
    assert len(found) == 200 and sum(r.ended for r in found.values()) == 199
    assert [d.seq for d in found["turn-199"].emitted()] == list(range(50))


def test_simulated_engine_keeps_its_pace_when_the_reader_runs_late() -> None:
    """A GPU's steps do not wait for the reader: tokens due while the reader's event
    loop was blocked arrive at once, and the sequence ends on time."""
    engine = SimEngine(ttft_ms=0, tokens_per_s=50)  # a token every 20 ms
    request = EngineRequest("r1", (ChatMessage(role="user", content="hi"),),
                            SamplingParams(max_tokens=10))

    async def read() -> tuple[list[str], float]:
        texts, start = [], time.monotonic()
        async for out in engine.generate(request):
            if not texts:  # the reader's loop is busy for 150 ms: 7 tokens fall due
                busy_until = time.monotonic() + 0.15
                while time.monotonic() < busy_until:
                    pass
            texts.append(out.text)
        return texts, time.monotonic() - start

    texts, elapsed = asyncio.run(read())
    assert texts == [sim_token_text(i) for i in range(10)]
    # Due at 9 x 20 ms = 180 ms; a simulator that slept a step after each token
    # would take the block on top (330 ms).
    assert elapsed < 0.26


def test_simulated_engine_steps_every_sequence_together_as_a_gpu_batch_does() -> None:
    """Sequences started at different moments get their tokens at the same steps, so
    the reader wakes once per step, not once per token."""
    engine = SimEngine(ttft_ms=5, tokens_per_s=50)  # a step every 20 ms

    async def times(request_id: str, after_s: float) -> list[float]:
        await asyncio.sleep(after_s)
        request = EngineRequest(request_id, (ChatMessage(role="user", content="hi"),),
                                SamplingParams(max_tokens=4))
        return [asyncio.get_running_loop().time() async for _ in engine.generate(request)]

    async def both() -> list[list[float]]:
        return list(await asyncio.gather(times("r1", 0.0), times("r2", 0.007)))

    first, second = asyncio.run(both())
    # A clock per sequence would give r2 each token 7 ms after r1's; one clock gives
    # them together (r2's first token may come a step later than r1's).
    together = [t for t in second if any(abs(t - u) < 0.002 for u in first)]
    assert len(together) >= 3, (first, second)


def test_session_priority_changes_only_a_session_of_its_own() -> None:
    own = subprocess.Popen(["sleep", "30"], start_new_session=True)
    shared = subprocess.Popen(["sleep", "30"])  # in this session: left alone
    try:
        autogroup = AUTOGROUP_SWITCH.exists() and AUTOGROUP_SWITCH.read_text().strip() == "1"
        before = Path(f"/proc/{shared.pid}/autogroup").read_text() if autogroup else ""
        assert lower_session_priority(own.pid, 7) is autogroup
        assert lower_session_priority(shared.pid, 7) is False
        if autogroup:
            assert Path(f"/proc/{own.pid}/autogroup").read_text().split()[-1] == "7"
            assert Path(f"/proc/{shared.pid}/autogroup").read_text() == before
    finally:
        own.kill()
        shared.kill()
        own.wait()
        shared.wait()


@pytest.mark.parametrize(("argv", "down"), [
    (["keys", "list"], "PostgreSQL does not answer at DATABASE_URL"),
    (["migrate"], "PostgreSQL does not answer at DATABASE_URL"),
    (["audit", str(uuid.UUID(int=0))], "Kafka does not answer at 127.0.0.1:"),
])
def test_a_command_whose_service_is_down_says_so_in_one_line(argv: list[str],
                                                            down: str) -> None:
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "DATABASE_URL": f"postgresql://u:secret@{closed}/db",
           "PIPELINE_KAFKA_BOOTSTRAP": closed}
    done = subprocess.run([sys.executable, "-m", "launch", *argv], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and down in done.stderr, done.stderr
    assert "secret" not in done.stderr


def test_the_local_database_being_down_points_at_infra_up() -> None:
    settings = CommonSettings(database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    with pytest.raises(psycopg.OperationalError) as err:
        psycopg.connect(settings.database_url, connect_timeout=5)
    said = service_down(err.value, settings, external_db=False)
    assert said is not None and said.endswith("`pipeline infra up` starts it")
    assert service_down(ValueError("not a service"), settings, external_db=False) is None


def test_loop_watch_reports_a_blocked_loop_once_with_where(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call that blocks the event loop is logged with the loop thread's stack, once per
    stall, and counted."""
    registry = CollectorRegistry()

    async def main() -> LoopWatch:
        watch = LoopWatch(registry, "unit", threshold_s=0.4)
        watch.start()
        await asyncio.sleep(0.3)  # the loop runs: nothing to report
        _block_the_loop(1.5)
        await asyncio.sleep(0.3)
        await watch.stop()
        return watch

    with caplog.at_level("ERROR", logger="pipeline.metrics"):
        asyncio.run(main())
    assert registry.get_sample_value("unit_event_loop_stalls_total") == 1
    (message,) = [r.getMessage() for r in caplog.records]
    assert "has not run for" in message and "_block_the_loop" in message


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)


def test_latency_sketch_merges_minutes_into_hours_within_one_percent() -> None:
    """Per-minute sketches added bin by bin give the hour's sketch exactly, and its
    quantiles are within 1% of the exact ones (lower-rank convention)."""
    rng = random.Random(7)
    minutes = [[rng.lognormvariate(3, 1.2) for _ in range(rng.randint(0, 400))]
               for _ in range(60)]
    minutes[5] = [0.0, 0.0005]  # at or below the smallest value: the lowest bin
    sketches = [Counter(sketch.bin_of(v) for v in values) for values in minutes]
    everything = sorted(v for values in minutes for v in values)
    merged = sketch.merge(sketches)
    assert merged == Counter(sketch.bin_of(v) for v in everything)
    for q, got in sketch.quantiles(merged, (0.0, 0.5, 0.95, 0.99, 1.0)).items():
        exact = everything[math.floor(q * (len(everything) - 1))]
        assert got is not None
        assert abs(got - max(exact, sketch.MIN_VALUE)) <= 0.01 * max(exact, sketch.MIN_VALUE)
    assert sketch.quantiles({}, (0.5,)) == {0.5: None}


def test_usage_query_pages_and_defaults() -> None:
    now = 1_800_000_123
    q = UsageQuery.build("t", None, now, "1d", now=now)
    assert q.start % 86400 == 0 and q.page_end == now  # the current day is the last bucket
    assert (now - q.start) // 86400 == 6  # 7 buckets by default
    paged = UsageQuery.build("t", now - 100 * 60, now, "1m", limit=30)
    assert paged.page_end == paged.start + 30 * 60
    for bad in ({"bucket_width": "1w"}, {"limit": 0}, {"group_by": ["project_id"]},
                {"page": "x"}, {"page": "-5"}, {"page": str(10**15)}):
        with pytest.raises(UsageError):
            UsageQuery.build("t", now - 60, now, **{"bucket_width": "1m", **bad})
    # Far-off times are refused, not a 500 from datetime (year 11476 is out of range).
    for start, end in ((300_000_000_000, 300_000_000_060), (now, 10**12), (-1, now)):
        with pytest.raises(UsageError, match="Unix time from 0 to 253402300799"):
            UsageQuery.build("t", start, end, "1d")
    assert UsageQuery.build("t", LATEST - 60, LATEST + 1, "1m").page_end == LATEST + 1


def test_metrics_port_in_use_is_named() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics(CollectorRegistry(), port)


# -- rollouts: routing and the health check -------------------------------------------
def _rollout(share: float, status: str = "running") -> Rollout:
    return Rollout(alias="chat", id="r1", stable="chat-v1", candidate="chat-v2",
                   share=share, status=status, started_at=0, updated_at=0)  # type: ignore[arg-type]


def test_a_rollout_sends_its_share_of_conversations_and_each_keeps_its_version() -> None:
    book = {"chat": _rollout(0.25)}
    live = {"chat-v1", "chat-v2"}
    conversations = [uuid.uuid4() for _ in range(4000)]
    picked = [route(book, "chat", c, live)[0] for c in conversations]
    assert 0.22 < picked.count("chat-v2") / len(picked) < 0.28
    assert [route(book, "chat", c, live)[0] for c in conversations] == picked  # sticky
    # No live candidate, or the rollout over: the stable version; no alias: the name itself.
    assert {route(book, "chat", c, {"chat-v1"})[0] for c in conversations} == {"chat-v1"}
    ended = {"chat": _rollout(0.25, "rolled_back")}
    assert {route(ended, "chat", c, live)[0] for c in conversations} == {"chat-v1"}
    assert route(book, "other", conversations[0], live) == ("other", None)


def test_the_health_check_compares_failures_and_ttft_with_the_old_version() -> None:
    policy = HealthPolicy(turns=10)
    old = Figures(turns=100, failures=1, ttft_p99_ms=80.0)
    assert judge(old, Figures(turns=10, failures=0, ttft_p99_ms=150.0), policy)[0]
    slow = judge(old, Figures(turns=10, failures=0, ttft_p99_ms=3000.0), policy)
    assert not slow[0] and "TTFT p99 3000 ms" in slow[1]
    failing = judge(old, Figures(turns=10, failures=1, ttft_p99_ms=80.0), policy)
    assert not failing[0] and "failure rate 10.0%" in failing[1]
    assert judge(Figures(), Figures(turns=10, ttft_p99_ms=80.0), policy)[0]


def test_the_health_fold_counts_each_turn_once_by_the_version_its_prompt_names() -> None:
    health = Health({"chat-v1", "chat-v2"})
    conv = uuid.uuid4()
    ids = {"conversation_id": conv}
    for rid, model in (("a", "chat-v1"), ("b", "chat-v2"), ("c", "chat-v2"), ("d", "x")):
        health.add(PromptSubmitted(**ids, request_id=rid, model=model,
                                   messages=(ChatMessage(role="user", content="hi"),)))
    end = {"reply_seq": 1, "text": "", "usage": Usage(prompt_tokens=1, completion_tokens=0),
           "deltas": 0, "duration_ms": 5.0}
    health.add(GenerationFinished(**ids, request_id="a", model="chat-v1", finish_reason="stop",
                                  ttft_ms=40.0, **end))
    health.add(GenerationFinished(**ids, request_id="b", model="chat-v2", finish_reason="stop",
                                  ttft_ms=90.0, **end))
    health.add(GenerationFailed(**ids, request_id="c", code="engine_dead", message="x"))
    health.add(GenerationFailed(**ids, request_id="d", code="engine_dead", message="x"))
    figures = health.figures()
    assert figures["chat-v1"] == Figures(turns=1, failures=0, ttft_p99_ms=40.0)
    assert figures["chat-v2"] == Figures(turns=2, failures=1, ttft_p99_ms=90.0)


def test_rollout_refuses_a_model_name_it_could_not_store_before_calling_kafka() -> None:
    env = {**os.environ, "PIPELINE_KAFKA_BOOTSTRAP": "127.0.0.1:1"}  # nothing listens there
    for args in (["a" * 201, "--to", "b"], ["chat", "--to", "v\x1b"]):
        done = subprocess.run([sys.executable, "-m", "launch", "rollout", *args],
                              capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2 and "1 to 200 printable characters" in done.stderr


def test_the_guard_asks_the_store_once_for_many_requests_waiting_on_the_same_answer() -> None:
    """10,000 streams opened at once each asked the store whether keys exist when the
    cached answer expired, and the pool's queue turned them into 503s: one query now
    serves every request waiting for it, and the next expiry asks again."""
    asked = 0

    async def ask() -> bool:
        nonlocal asked
        asked += 1
        await asyncio.sleep(0.05)
        return True

    async def scenario() -> list[bool]:
        guard = Guard(pool=None, require=False)  # type: ignore[arg-type]
        together = await asyncio.gather(*(guard._once("enabled", ask) for _ in range(500)))
        later = await guard._once("enabled", ask)
        return [*together, later]

    answers = asyncio.run(scenario())
    assert all(answers) and len(answers) == 501 and asked == 2


def test_of_two_rollouts_started_at_once_exactly_one_goes_on() -> None:
    """Each command watching a rollout stands down when it sees a rollout of its alias
    started after its own; progress records it wrote since do not hide that rollout."""
    def record(rid: str, started: float, updated: float) -> Rollout:
        return Rollout(alias="chat", id=rid, stable="v1", candidate="v2", share=0.5,
                       started_at=started, updated_at=updated)

    a, b = record("a", 100.0, 100.0), record("b", 100.0, 100.0)  # the same instant
    a_later = record("a", 100.0, 105.0)  # a's progress, written after b's start
    history = [a, b, a_later]
    assert newer_rollout(history, a) == b and newer_rollout(history, b) is None
    older = record("old", 50.0, 50.0)
    assert newer_rollout([older, a], a) is None
    assert newer_rollout([older, a], older) == a


def test_a_rollouts_end_stands_against_progress_written_after_it() -> None:
    """A watching command's progress record, written just after an operator's abort,
    does not set the rollout running again; a new rollout's records are not stale."""
    running = Rollout(alias="chat", id="a", stable="v1", candidate="v2", share=0.5,
                      started_at=100.0, updated_at=100.0)
    ended = running.model_copy(update={"status": "rolled_back", "updated_at": 104.0})
    progress = running.model_copy(update={"updated_at": 105.0})
    assert stale(ended, progress)
    assert not stale(running, progress) and not stale(running, ended) and not stale(None, running)
    assert not stale(ended, progress.model_copy(update={"id": "b"}))


def test_a_long_takeover_read_logs_how_far_it_has_come(caplog: pytest.LogCaptureFixture) -> None:
    since = int(time.time() * 1000) - 100_000
    records = [Record(Position("chat.generations", 0, i), None, b"{}", since + i * 25_000)
               for i in range(4)]
    with caplog.at_level(logging.INFO, logger="workers.takeover"):
        assert list(reported(records, since, "reading chat.generations", every_s=0)) == records
    assert [r.getMessage() for r in caplog.records] == [
        f"taking over: reading chat.generations: {i + 1} records in 0 s, {25 * i}% of the way "
        "to now" for i in range(4)]


def test_a_pair_bench_alternates_its_sides_and_gives_the_median_of_each_pairs_ratio() -> None:
    from bench import pair

    assert pair.order(3) == ["A", "B", "B", "A", "A", "B"]

    def point(broker: float, gateway: float, p99: float) -> dict[str, object]:
        return {"cpu_us_per_token": {"kafka broker": broker, "gateway": gateway,
                                     "load generator": 50.0},
                "ms": {"p50": p99 / 2, "p99": p99}, "kafka_hop_ms": {"p99": p99 / 3},
                "transactions_per_s": broker / 2, "gateway_transactions_per_s": gateway / 2,
                "ttft_ms": {"p50": p99 + 50}}

    # Side B halves the broker in the first pair, costs it a quarter less in the second
    # and a third less in the third; the gateway is the same on both sides.
    brokers = [(100.0, 50.0), (80.0, 60.0), (90.0, 60.0)]
    runs = [{"side": side, "pair": i // 2,
             "figures": pair.figures(point(brokers[i // 2][side == "B"], 70.0, 40.0))}
            for i, side in enumerate(pair.order(3))]
    runs.append({"side": "A", "pair": 3, "figures": pair.figures(point(1.0, 1.0, 1.0))})
    summary = pair.summarise(runs)  # the unpaired last run counts in nothing
    assert summary["kafka broker"] == pytest.approx(
        {"A": 90.0, "B": 60.0, "ratio": 2 / 3, "least": 0.5, "most": 0.75})
    assert summary["gateway"]["ratio"] == summary["load generator"]["ratio"] == 1.0
    assert summary["total"]["A"] == 160.0 and summary["total"]["B"] == 130.0
    assert summary["p99 ms"]["ratio"] == 1.0
    assert "| kafka broker µs/token | 90.0 | 60.0 | 0.67x (0.50 - 0.75) |" in pair.table(summary)
    assert "| transactions/s | 45.0 | 30.0 | 0.67x (0.50 - 0.75) |" in pair.table(summary)
    assert "| gateway transactions/s | 35.0 | 35.0 | 1.00x (1.00 - 1.00) |" in pair.table(summary)
    assert "| ttft p50 ms | 90.0 | 90.0 | 1.00x (1.00 - 1.00) |" in pair.table(summary)


@pytest.mark.parametrize(("argv", "code", "said"), [
    (["pair"], 1, "the sides are the same"),
    (["capacity", "--b-env", "WORKER_TRANSACTION_INTERVAL_MS=10"], 1,
     "are for pipeline bench pair"),
    (["pair", "--b-env", "WORKER_TRANSACTION_INTERVAL_MS"], 2, "expected NAME=VALUE"),
    (["pair", "--b-env", "A=1", "--rate", "0"], 2, "above 0 and at most 1000"),
    (["pair", "--b-env", "A=1", "--label", "../elsewhere"], 2, "letters, digits"),
    (["pair", "--b-tree", "/"], 2, "not a checkout of this project"),
    (["pair", "--b-python", "/nonexistent/python"], 2, "not an executable file"),
    (["pair", "--b-python", "/bin/true"], 2, "cannot run this project (it is not a Python)"),
    (["capacity", "--a-python", sys.executable], 1, "are for pipeline bench pair"),
])
def test_a_pair_bench_given_what_it_cannot_run_says_why_and_runs_nothing(
        argv: list[str], code: int, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "launch", "bench", *argv], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == code and said in done.stderr, done.stderr


def test_the_load_generator_reads_sse_messages_split_anyhow_and_times_each_by_its_last_read(
) -> None:
    """The bench's client keeps each socket read with its time and parses after the run:
    a message is timed by the read that completed it, whatever the split (CRLF too)."""
    from aiohttp import web

    from bench.loadgen import http_client, run_load, stream_once

    def data(payload: str, event_id: str | None = None) -> bytes:
        with_id = f',"event_id":"{event_id}"' if event_id else ""
        return f'data: {{"choices":[{{"delta":{{"content":"{payload}"}}}}]{with_id}}}'.encode()

    usage = b'data: {"choices":[],"usage":{"completion_tokens":2}}'
    writes = [data("", "0-1") + b"\n\n" + data("t0 ", "0-2")[:20],  # role, half a token
              data("t0 ", "0-2")[20:] + b"\r\n\r\n" + data("t1 ", "0-3") + b"\r",
              b"\n\r\n" + usage + b"\n\n",  # a CRLF blank line split across reads
              b"data: [DONE]\n\n"]

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in writes:
            await resp.write(chunk)
            await asyncio.sleep(0.05)  # each write its own read
        return resp

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", sse)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with http_client(2) as client:
                load = await run_load(lambda _i: stream_once(
                    client, f"http://127.0.0.1:{port}", {}, keep_ids=True), 1, 1)
        finally:
            await runner.cleanup()
        (request,) = load.requests
        assert request.error is None and request.reads is None  # parsed, and let go
        assert request.text == ["", "t0 ", "t1 "] and request.tokens == 2
        ids = [event_id for event_id, _ in request.arrivals]
        times = [at for _, at in request.arrivals]
        assert ids == ["0-1", "0-2", "0-3"]
        # "0-2" was completed by the second read, "0-3" by the third, ~50 ms apart each.
        assert times[1] - times[0] > 0.03 and times[2] - times[1] > 0.03
        assert request.first == times[1]  # the first content, not the role chunk
        assert request.ended is not None and request.ended - times[2] > 0.03

    asyncio.run(scenario())


def test_a_stream_the_load_generator_read_without_its_done_is_an_error() -> None:
    from bench.loadgen import Request

    cut = Request(0.0, reads=[(1.0, b'data: {"choices":[{"delta":{"content":"t0 "}}]}\n\n')])
    cut.parse()
    assert cut.error == "no [DONE]" and cut.first == 1.0
    untimed = Request(0.0, ended=2.0)  # not an SSE stream (an engine's own request)
    untimed.parse()
    assert untimed.error is None


def test_a_paired_serving_bench_says_each_pair_as_it_ends(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import serving
    from bench.loadgen import Request

    monkeypatch.setattr(serving, "SETTLE_S", 0.0)

    def maker(tokens: int) -> Callable[[int], Awaitable[Request]]:
        async def one(_seed: int) -> Request:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            return Request(now - 0.01, first=now - 0.005, ended=now, tokens=tokens)
        return one

    out = asyncio.run(serving.paired(maker(10), maker(5), [1, 2], quick=True, per_client=2,
                                     names=("engine", "worker")))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("serving:")]
    assert [line.split(":")[1] for line in lines] == [
        f" worker / engine at {c} clients, pair {i} of 3" for c in (1, 2) for i in (1, 2, 3)]
    assert all(line.endswith("%") for line in lines)
    assert [len(level) for level in out.ratios] == [3, 3]
    assert all(0.3 < ratio < 0.7 for level in out.ratios for ratio in level)  # 5 / 10 tokens


def test_event_streams_refuse_a_middleware_that_could_touch_their_bodies() -> None:
    """SSE bodies go straight to the server's send, past every middleware: the app takes
    only middleware that says it acts on the start message alone (ServerSend)."""
    from starlette.middleware.gzip import GZipMiddleware

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    app = create_app(GatewaySettings(), CommonSettings())
    assert len(app.user_middleware) == 6  # the gateway's own: each says START_ONLY
    with pytest.raises(TypeError, match="START_ONLY"):
        app.add_middleware(GZipMiddleware)


def test_every_command_the_cli_parses_has_what_runs_it() -> None:
    import argparse

    from launch.cli import COMMANDS
    from launch.parser import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(COMMANDS)
