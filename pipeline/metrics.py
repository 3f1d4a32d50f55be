"""Prometheus helpers. Each service owns its registry; nothing is global."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
    """Expose ``registry`` on http://host:port/metrics (port 0: not exposed)."""
    if port:
        start_http_server(port, addr=host, registry=registry)
