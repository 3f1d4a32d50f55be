"""One chat turn end to end: openai client -> gateway -> Kafka -> vLLM worker -> Kafka
-> gateway (SSE), and -> projector -> Postgres. Real broker, real database, real engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import httpx
import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from openai import OpenAI

from pipeline.kafka import client_config
from pipeline.topics import GENERATIONS, PROMPTS, workers_group
from schemas import GenerationFinished, GenerationStarted, PromptSubmitted
from schemas.conversation import storable
from schemas.history import digest
from schemas.live import Delta, End, Start
from tests.conftest import MODEL, Pipeline
from tests.logread import model_input, read_events, read_live
from tests.sse import resume_chat, scrape, stream_chat

pytestmark = pytest.mark.integration


@pytest.fixture
def client(pipeline: Pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.url}/v1", api_key="not-needed", max_retries=0,
                  timeout=120)


def stored_messages(pipeline: Pipeline, session: str) -> list[dict]:
    r = httpx.get(f"{pipeline.url}/v1/sessions/{session}/messages", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def generation_events(pipeline: Pipeline, request_id: str) -> list:
    return [e for _, e in read_events(pipeline.stack.bootstrap, GENERATIONS)
            if e.request_id == request_id]


def test_models_lists_the_served_model(pipeline: Pipeline, client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_turn_is_logged_in_order_and_stored(pipeline: Pipeline, client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, max_tokens=16, seed=7,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Tell me about the log."}],
    )
    session = raw.headers["x-session-id"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage

    assert finish in (["stop"], ["length"])
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.prompt_tokens > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    request_id = chunks[0].id

    # The durable record holds the turn: the prompt, then Started and Finished with the
    # whole text, no delta; the live stream its start, gap-free deltas and its end.
    prompts = [(p, e) for p, e in read_events(pipeline.stack.bootstrap, PROMPTS)
               if e.request_id == request_id]
    assert len(prompts) == 1 and isinstance(prompts[0][1], PromptSubmitted)
    (position, prompt), = prompts
    assert str(prompt.conversation_id) == session
    events = generation_events(pipeline, request_id)
    assert [type(e) for e in events] == [GenerationStarted, GenerationFinished]
    assert events[0].ref == events[1].ref == position.offset
    live = [i for i in read_live(pipeline.stack.bootstrap) if i.request_id == request_id]
    assert isinstance(live[0].item, Start) and isinstance(live[-1].item, End)
    deltas = [i.item for i in live if isinstance(i.item, Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert events[-1].deltas == live[-1].item.deltas == len(deltas)
    assert "".join(d.text for d in deltas) == events[-1].text == text
    assert events[-1].usage.completion_tokens == usage.completion_tokens
    assert sum(len(d.token_ids) for d in deltas) == usage.completion_tokens

    # The projection stored both messages; the assistant's is exactly what was streamed,
    # as the store keeps text (a NUL, which the tiny model may say, as U+FFFD).
    stored = stored_messages(pipeline, session)
    assert [(m["seq"], m["role"]) for m in stored] == [(0, "user"), (1, "assistant")]
    assert stored[0]["content"] == "Tell me about the log."
    assert stored[1]["content"] == storable(text)

    with psycopg.connect(pipeline.stack.database_url) as conn:
        row = conn.execute(
            "SELECT status, model, completion_tokens, prompt_tokens, finish_reason"
            " FROM generations WHERE request_id = %s", (request_id,)).fetchone()
    assert row == ("finished", MODEL, usage.completion_tokens, usage.prompt_tokens, finish[0])


def test_non_streaming_turn(pipeline: Pipeline, client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=8, temperature=0.5, top_p=0.9,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "hi"}],
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == (completion.usage.prompt_tokens
                                             + completion.usage.completion_tokens)
    stored = stored_messages(pipeline, raw.headers["x-session-id"])
    assert [m["role"] for m in stored] == ["system", "user", "assistant"]
    assert stored[2]["content"] == storable(choice.message.content or "")


def test_second_turn_sees_the_first(pipeline: Pipeline, client: OpenAI) -> None:
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "first question"}])
    session = first.headers["x-session-id"]
    first_reply = first.parse().choices[0].message.content

    second = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=6, stream=True, extra_headers={"X-Session-Id": session},
        messages=[{"role": "user", "content": "second question"}])
    assert second.headers["x-session-id"] == session
    chunks = list(second.parse())
    second_reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # The prompt carries its own message and names the first turn; what the model was
    # given, rebuilt from the durable record, is the whole session, as the gateway read it.
    prompt = next(e for _, e in read_events(pipeline.stack.bootstrap, PROMPTS)
                  if e.request_id == chunks[0].id)
    assert isinstance(prompt, PromptSubmitted)
    assert [(m.role, m.content) for m in prompt.messages] == [("user", "second question")]
    assert prompt.history_len == 2 and prompt.previous is not None and prompt.history is None
    given = model_input(pipeline.stack.bootstrap, chunks[0].id)
    assert given is not None and [(m.role, m.content) for m in given] == [
        ("user", "first question"), ("assistant", first_reply), ("user", "second question")]
    assert prompt.history_digest == digest(given[:2])
    assert scrape(pipeline.worker_metrics).get("worker_history_mismatches_total") == 0

    stored = stored_messages(pipeline, session)
    assert [(m["seq"], m["role"], m["content"]) for m in stored] == [
        (0, "user", "first question"), (1, "assistant", first_reply),
        (2, "user", "second question"), (3, "assistant", second_reply)]


def test_metrics_and_health(pipeline: Pipeline) -> None:
    assert httpx.get(f"{pipeline.url}/health").json() == {"status": "ok"}
    body = httpx.get(f"{pipeline.url}/metrics").text
    assert "gateway_turns_accepted_total" in body
    accepted = next(line for line in body.splitlines()
                    if line.startswith("gateway_turns_accepted_total"))
    assert float(accepted.split()[1]) >= 1
    # Each accepted prompt was committed in one of the gateway's transactions, and
    # prompts accepted together may share one.
    gateway = scrape(f"{pipeline.url}/metrics")
    assert 1 <= gateway["gateway_prompt_transactions"] <= gateway["gateway_turns_accepted_total"]
    worker = scrape(pipeline.worker_metrics)  # the vLLM worker's own
    assert worker["worker_generated_tokens_total"] > 0
    assert 'worker_model_info{model="tiny-random-llama"}' in worker
    for gauge in ("worker_kv_cache_usage", "worker_batch_utilisation", "worker_transactions",
                  "worker_in_flight_peak", "worker_assigned_partitions"):
        assert gauge in worker, gauge
    # Measured off their writes' broker times; on one host, a delivery's latency apart.
    for clock in (gateway["gateway_broker_clock_ahead_seconds"],
                  worker["worker_broker_clock_ahead_seconds"]):
        assert 0 < abs(clock) < 5, clock


def test_vllm_stream_resumes_after_a_disconnect(pipeline: Pipeline) -> None:
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True,
            "messages": [{"role": "user", "content": "keep going"}]}
    first = stream_chat(pipeline.url, body, stop_after=3)
    rest = resume_chat(pipeline.url, first.request_id, first.last_id)
    assert rest.done and rest.error is None
    final = next(e for e in generation_events(pipeline, first.request_id)
                 if isinstance(e, GenerationFinished))
    assert first.text + rest.text == final.text and final.usage.completion_tokens == 300


def test_vllms_own_benchmark_client_measures_the_gateway(pipeline: Pipeline) -> None:
    """``vllm bench serve --backend openai-chat``'s request function, imported unchanged
    from the installed vllm: it splits messages on blank lines and reads only ``data:``."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
    )

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(async_request_openai_chat_completions(
                RequestFuncInput(prompt=f"Count to {i}.", api_url=f"{pipeline.url}/v1/chat/"
                                 "completions", prompt_len=0, output_len=24, model=MODEL,
                                 ignore_eos=True), session) for i in range(4)))

    outputs = asyncio.run(run())
    assert [o.error for o in outputs] == [""] * 4 and all(o.success for o in outputs)
    finished = {e.text for _, e in read_events(pipeline.stack.bootstrap, GENERATIONS)
                if isinstance(e, GenerationFinished)}
    for out in outputs:
        assert out.ttft > 0 and out.latency >= out.ttft
        assert len(out.itl) >= 1 and all(t >= 0 for t in out.itl)
        assert out.output_tokens == 24 and out.prompt_len > 0  # from the usage chunk
        assert out.generated_text in finished


def test_the_broker_tells_each_services_clients_apart(
        pipeline: Pipeline, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client of every service was ``rdkafka`` to the broker: its request logs,
    its per-client metrics and its quotas could not tell a gateway's tail from a worker's
    transactions. Each client now names its service and its part
    (``chat-<service>/<part>``), as the members of the worker's and the projector's
    groups show; a ``client.id`` of the operator's own (their quotas') is kept."""
    admin = AdminClient({"bootstrap.servers": pipeline.stack.bootstrap})
    expected = {"projector": "chat-projector/projector",
                workers_group(MODEL): f"chat-worker/{MODEL}"}
    for group, described in admin.describe_consumer_groups(list(expected)).items():
        members = described.result(30).members
        assert members and {m.client_id for m in members} == {expected[group]}, group

    properties = tmp_path / "client.properties"
    properties.write_text("client.id=tenant-a-pipeline\n")
    monkeypatch.setenv("PIPELINE_KAFKA_CONFIG", str(properties))
    assert client_config("127.0.0.1:9092", "tail")["client.id"] == "tenant-a-pipeline"
