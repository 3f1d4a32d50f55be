"""Traces of turns: W3C trace context from the HTTP request into the prompt record's
headers, on to the worker, and back to the gateway's stream; OpenTelemetry spans,
exported by OTLP (HTTP/protobuf) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, and not at all otherwise.

A turn's trace (one per request; a client's ``traceparent`` makes it part of its own):
``chat.request`` (the gateway, the whole HTTP exchange) with ``chat.accept`` (until the
prompt is durable) and ``chat.stream`` (until the last event is sent) in it, and
``chat.delta_hop`` (the first live record, from the worker's write to the gateway's
read); the worker's ``chat.queue`` (from the prompt's append to the log to the engine
taking it) and ``chat.engine`` (the generation) are children of ``chat.request``, by the
record's headers, and vLLM's own ``llm_request`` span is a child of ``chat.engine``.
Context is always passed on, so a traced client's trace goes through a gateway that
exports nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

__all__ = ["TRACER", "Context", "Span", "carrier_of", "enabled", "from_http", "from_record",
           "ms_to_ns", "record_headers", "setup_tracing", "traces_endpoint"]

TRACER = trace.get_tracer("chat-pipeline")
_enabled = False


def setup_tracing(service: str) -> bool:
    """Export this process's spans if an OTLP endpoint is configured (the standard
    ``OTEL_*`` variables); True if so. The service is ``chat-pipeline-<service>`` unless
    ``OTEL_SERVICE_NAME`` names it."""
    global _enabled
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not endpoint or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"chat-pipeline-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)  # flushed at exit
    _enabled = True
    return True


def enabled() -> bool:
    return _enabled


def traces_endpoint() -> str | None:
    """Where spans go (OTLP/HTTP), for engines that export their own (vLLM)."""
    explicit = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if explicit:
        return explicit
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return f"{base.rstrip('/')}/v1/traces" if base else None


def carrier_of(span: Span) -> dict[str, str]:
    """``span``'s context as W3C headers, for a library that takes them (vLLM's
    ``trace_headers``): its spans become children of ``span``."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def from_http(headers: Mapping[str, str]) -> Context:
    """The caller's trace context (``traceparent``, ``tracestate``), if it sent one."""
    return propagate.extract(headers)


def record_headers(context: Context | None = None) -> list[tuple[str, bytes]]:
    """The current (or given) trace context as Kafka record headers; none without one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return [(k, v.encode()) for k, v in carrier.items()]


def from_record(headers: Sequence[tuple[str, str | bytes | None]] | None) -> Context | None:
    """The trace context a record's headers carry, or None."""
    if not headers:
        return None
    carrier = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in headers
               if v is not None and k in ("traceparent", "tracestate")}
    return propagate.extract(carrier) if "traceparent" in carrier else None


def ms_to_ns(ms: float) -> int:
    return int(ms * 1_000_000)
