"""Prometheus helpers. Each service owns its registry; nothing is global."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server


def serve_metrics(registry: CollectorRegistry, port: int,
                  host: str = "127.0.0.1") -> Callable[[], None]:
    """Expose ``registry`` on http://host:port/metrics (port 0: not exposed); return what
    stops it."""
    if not port:
        return lambda: None
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        thread.join()

    return stop
