"""Traces: a turn crosses the gateway, the log, a worker, the log again and the gateway's
tail, and one trace follows it. The gateway and a worker (SIMULATED engine) export by
OTLP/HTTP to a collector this test runs; the trace it gets back is read span by span."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from infra.process import free_port
from projections.migrate import migrate
from tests.conftest import (
    Service,
    Stack,
    new_database,
    own_broker,
    start_service,
    wait_healthy,
)
from tests.sse import stream_chat

MODEL = "traced-sim"
VLLM_MODEL = "traced-vllm"
SPANS = {"chat.request", "chat.accept", "chat.stream", "chat.delta_hop", "chat.queue",
         "chat.engine"}


@dataclass(frozen=True)
class Exported:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


class Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: what the services export, kept."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[Exported] = []
        self.lock = threading.Lock()

    def of_trace(self, trace_id: str) -> dict[str, Exported]:
        with self.lock:
            return {s.name: s for s in self.spans if s.trace_id == trace_id}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        got = []
        for resource in request.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes
                           if a.key == "service.name")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    got.append(Exported(
                        service, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), span.name, span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        {a.key: (a.value.string_value or a.value.int_value
                                 or a.value.bool_value) for a in span.attributes}))
        with self.server.lock:
            self.server.spans.extend(got)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass
class Traced:
    url: str
    collector: Collector
    services: list[Service]


@pytest.fixture(scope="module")
def traced(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    collector = Collector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    with own_broker(tmp_path_factory, "traces") as bootstrap:
        services: list[Service] = []
        try:
            own = Stack(bootstrap, new_database(stack.database_url, "traces"), stack.logs)
            migrate(own.database_url)
            otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
                    "OTEL_BSP_SCHEDULE_DELAY": "100"}
            port = free_port()
            services = [
                start_service(own, "traced-worker", "worker", "--engine", "sim",
                              "--served-model-name", MODEL, "--metrics-port", str(free_port()),
                              WORKER_SIM_TOKENS_PER_S="100", **otel),
                # vLLM (the tiny model), whose own request spans join the turn's trace.
                start_service(own, "traced-vllm-worker", "worker", "--served-model-name",
                              VLLM_MODEL, "--max-num-seqs", "4", **otel),
                start_service(own, "traced-gateway", "gateway", "--port", str(port),
                              GATEWAY_MODELS=f"{MODEL},{VLLM_MODEL}", **otel),
            ]
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, services, timeout=90)
            yield Traced(url, collector, services)
        finally:
            for service in services:
                service.stop()
            collector.shutdown()
            collector.server_close()


def _trace_of(traced: Traced, trace_id: str,
              wanted: frozenset[str] = frozenset(SPANS)) -> dict[str, Exported]:
    deadline = time.monotonic() + 60
    while True:
        spans = traced.collector.of_trace(trace_id)
        if wanted <= set(spans):
            return spans
        assert time.monotonic() < deadline, (sorted(spans), [s.tail() for s in traced.services])
        time.sleep(0.1)


def test_one_trace_follows_a_turn_through_every_hop(traced: Traced) -> None:
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    tokens = 20
    done = stream_chat(traced.url, {"model": MODEL, "max_tokens": tokens,
                                    "messages": [{"role": "user", "content": "trace me"}]},
                       headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert done.done, done.error
    spans = _trace_of(traced, trace_id)
    request = spans["chat.request"]
    assert request.parent_id == client_span  # the client's trace goes on
    assert request.attributes["chat.request_id"] == done.request_id
    for name in SPANS - {"chat.request"}:
        assert spans[name].parent_id == request.span_id, name
    assert {n: s.service for n, s in spans.items()} == {
        "chat.request": "chat-pipeline-gateway", "chat.accept": "chat-pipeline-gateway",
        "chat.stream": "chat-pipeline-gateway", "chat.delta_hop": "chat-pipeline-gateway",
        "chat.queue": "chat-pipeline-worker", "chat.engine": "chat-pipeline-worker"}
    accept, queue, engine = spans["chat.accept"], spans["chat.queue"], spans["chat.engine"]
    hop, stream = spans["chat.delta_hop"], spans["chat.stream"]
    # In the order a turn lives them (one host's clock; a millisecond of the log's time).
    slack = 2_000_000
    assert request.start_ns <= accept.start_ns <= queue.start_ns + slack
    assert queue.start_ns <= queue.end_ns <= engine.start_ns + slack
    assert engine.start_ns <= hop.start_ns + slack and hop.start_ns <= hop.end_ns
    assert hop.end_ns <= stream.end_ns <= request.end_ns
    assert engine.attributes["gen_ai.usage.output_tokens"] == tokens
    assert engine.attributes["chat.request_id"] == done.request_id


def test_a_request_without_a_trace_starts_its_own(traced: Traced) -> None:
    done = stream_chat(traced.url, {"model": MODEL, "max_tokens": 3,
                                    "messages": [{"role": "user", "content": "untraced"}]})
    assert done.done
    deadline = time.monotonic() + 60
    while True:
        with traced.collector.lock:
            roots = [s for s in traced.collector.spans if s.name == "chat.request"
                     and s.attributes.get("chat.request_id") == done.request_id]
        if roots:
            break
        assert time.monotonic() < deadline, "no chat.request span"
        time.sleep(0.1)
    (root,) = roots
    assert root.parent_id == ""
    spans = _trace_of(traced, root.trace_id)
    assert spans["chat.engine"].parent_id == root.span_id


def test_vllms_own_request_span_is_in_the_turns_trace(traced: Traced) -> None:
    """vLLM traces its requests (``llm_request``, with its own timings) when given an
    endpoint: the worker gives it the turn's context, so the span is ``chat.engine``'s
    child."""
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    done = stream_chat(traced.url, {"model": VLLM_MODEL, "max_tokens": 8, "ignore_eos": True,
                                    "messages": [{"role": "user", "content": "trace vllm"}]},
                       headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
                       timeout=300)
    assert done.done, (done.error, [s.tail() for s in traced.services])
    spans = _trace_of(traced, trace_id, frozenset(SPANS | {"llm_request"}))
    assert spans["llm_request"].parent_id == spans["chat.engine"].span_id
    assert spans["chat.engine"].start_ns <= spans["llm_request"].start_ns


def test_no_span_holds_what_a_client_wrote(traced: Traced) -> None:
    """A marker in a turn's messages, stop strings, user and Idempotency-Key, and in the
    model name of a refused request, is in no attribute of any span either sends."""
    marker = f"MK{uuid.uuid4().hex[:12]}"
    served, refused = uuid.uuid4().hex, uuid.uuid4().hex
    done = stream_chat(traced.url, {
        "model": VLLM_MODEL, "max_tokens": 4, "user": f"{marker}-user",
        "stop": [f"{marker} stop"], "messages": [{"role": "user", "content": f"{marker}"}]},
        headers={"traceparent": f"00-{served}-{uuid.uuid4().hex[:16]}-01",
                 "Idempotency-Key": f"{marker}-key"})
    assert done.done, done.error
    r = httpx.post(f"{traced.url}/v1/chat/completions", timeout=30,
                   headers={"traceparent": f"00-{refused}-{uuid.uuid4().hex[:16]}-01"},
                   json={"model": f"{marker}-model",
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404, r.text
    spans = [*_trace_of(traced, served).values(),
             *_trace_of(traced, refused, frozenset({"chat.request"})).values()]
    leaks = [(s.name, k, v) for s in spans for k, v in s.attributes.items()
             if marker in str(v)]
    assert spans and leaks == [], leaks
