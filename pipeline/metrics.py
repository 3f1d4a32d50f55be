"""Prometheus helpers. Each service owns its registry; nothing is global."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

log = logging.getLogger(__name__)
# Every latency histogram's buckets, in seconds (one set, so the dashboards' quantiles
# compare across services): from a token's 5 ms to a long turn's two minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


# The label value the series past a ``LabelCap`` share.
OTHER = "(other)"


class LabelCap:
    """The values a label drawn from an open set (tenants, models named in records) may
    take in one registry: the first ``limit`` seen each keep their own series, and every
    value after them shares ``OTHER``. A registry, and each scrape of it, then stays the
    same size however many tenants the log has ever held. ``kept`` is how many have
    their own."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: set[str] = set()

    @property
    def kept(self) -> int:
        return len(self._kept)

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        if len(self._kept) < self.limit:
            self._kept.add(value)
            return value
        return OTHER


class LoopCounter:
    """A counter one thread alone adds to (an event loop's), with no lock: for a path
    taken per token. ``prometheus_client``'s counter takes a lock per ``inc``. Scraped as
    a Prometheus counter (``<name>_total``); a scrape from another thread reads a whole
    number, of before or after an addition."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self.value)


class LoopHistogram:
    """A histogram one thread alone observes into (an event loop's), with no lock: for a
    path taken per token. ``prometheus_client``'s takes two locks per ``observe`` and walks
    its buckets in Python; this finds the bucket by bisection. Scraped as a Prometheus
    histogram (cumulative buckets, ``_count``, ``_sum``), from a copy of the counts."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = sorted(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation)

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(repr, map(float, self._bounds)), "+Inf"], counts,
                                strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets,
                                    sum_value=total)


def serve_metrics(registry: CollectorRegistry, port: int,
                  host: str = "127.0.0.1") -> Callable[[], None]:
    """Expose ``registry`` on http://host:port/metrics (port 0: not exposed); return what
    stops it."""
    if not port:
        return lambda: None
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") \
            from None

    def stop() -> None:
        server.shutdown()
        thread.join()

    return stop


class LoopWatch:
    """Notices an asyncio loop that has stopped running (a call that blocks it: every
    request it serves, ``/readyz`` included, waits meanwhile) and logs, once per stall,
    how long it has been stuck and the loop thread's stack, counting the stalls."""

    def __init__(self, registry: CollectorRegistry, prefix: str,
                 threshold_s: float = 2.0) -> None:
        self.threshold_s = threshold_s
        self.stalls = Counter(f"{prefix}_event_loop_stalls",
                              f"Times the event loop did not run for {threshold_s:g} s or more",
                              registry=registry)
        self._beat = time.monotonic()
        self._thread_id = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self._thread_id = threading.get_ident()
        self._task = asyncio.create_task(self._beating(), name="loop-watch")
        threading.Thread(target=self._watch, name="loop-watch", daemon=True).start()

    async def _beating(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.threshold_s / 10)

    def _watch(self) -> None:
        reported = 0.0  # the beat of the stall already reported
        while not self._stop.wait(self.threshold_s / 4):
            beat = self._beat
            stuck = time.monotonic() - beat
            if stuck < self.threshold_s or beat == reported:
                continue
            reported = beat
            self.stalls.inc()
            frame = sys._current_frames().get(self._thread_id)
            where = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
            log.error("the event loop has not run for %.1f s; it is at:\n%s", stuck, where)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
