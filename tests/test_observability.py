"""What the services tell of themselves, without a broker: the event loop's watch
(``pipeline.metrics.LoopWatch``) and the latency sketch (``schemas.sketch``)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pipeline.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram, LoopWatch
from schemas import (
    sketch,
)


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


def test_loop_metrics_scrape_as_prometheus_clients_own() -> None:
    """The worker's per-token counter and histogram, kept without locks, expose the
    series ``prometheus_client``'s would, value for value (the dashboards read them)."""
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("t_seconds", "d", buckets=LATENCY_BUCKETS, registry=theirs)
    counter = prometheus_client.Counter("t_tokens", "d", registry=theirs)
    loop_histogram = LoopHistogram("t_seconds", "d", LATENCY_BUCKETS, ours)
    loop_counter = LoopCounter("t_tokens", "d", ours)
    for value in (0.0, 0.005, 0.0051, 0.3, 1, 119.9, 120, 1e6):  # on, past and above bounds
        histogram.observe(value)
        loop_histogram.observe(value)
    counter.inc(3)
    loop_counter.inc(3)
    expected = [line for line in generate_latest(theirs).decode().splitlines()
                if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected


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
