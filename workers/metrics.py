"""A worker's Prometheus metrics, on the registry its process owns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram
from workers.engine import Engine
from workers.history import HistoryMetrics


@dataclass(frozen=True)
class Readings:
    """What the worker's gauges read of it, each time they are scraped."""

    waiting: Callable[[], int]  # prompts taken and not yet running in the engine
    transactions: Callable[[], int]
    history_chars: Callable[[], int]
    live_records: Callable[[], int]
    broker_clock_ahead_s: Callable[[], float]


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, engine: Engine, readings: Readings) -> None:
        model = engine.model_name
        Gauge("worker_running_sequences", "Generations the engine is running",
              registry=registry).set_function(engine.running)
        Gauge("worker_waiting_sequences", "Prompts taken but not yet running in the engine",
              registry=registry).set_function(readings.waiting)
        Gauge("worker_batch_utilisation", "Running sequences / max_num_seqs",
              registry=registry).set_function(lambda: engine.running() / engine.max_num_seqs)
        Gauge("worker_kv_cache_usage", "KV-cache usage as the engine reports it (0-1)",
              registry=registry).set_function(lambda: engine.kv_cache_usage() or 0.0)
        Gauge("worker_transactions", "Transactions committed", registry=registry
              ).set_function(readings.transactions)
        Gauge("worker_broker_clock_ahead_seconds", "The Kafka brokers' clock less this "
              "host's, read off its heartbeats: keep it within 60 s either way",
              registry=registry
              ).set_function(readings.broker_clock_ahead_s)
        Gauge("worker_model_info", "The model this worker serves", ["model"],
              registry=registry).labels(model).set(1)
        self.in_flight_peak = Gauge("worker_in_flight_peak",
                                    "Most generations ever in flight at once",
                                    registry=registry)
        self.lag = Gauge("worker_prompt_lag", "Prompts behind the end of the assigned partitions",
                         registry=registry)
        self.assigned = Gauge("worker_assigned_partitions", "Prompt partitions this worker owns",
                              registry=registry)
        # Counted per token, on the event loop: without a lock (``LoopCounter``).
        self.tokens = LoopCounter("worker_generated_tokens", "Tokens generated", registry)
        self.generations = Counter("worker_generations", "Generations ended, by outcome",
                                   ["outcome"], registry=registry)
        self.resumed = Counter("worker_resumed_generations",
                               "Turns continued from an earlier attempt", registry=registry)
        self.interrupted = Counter("worker_interrupted_turns",
                                   "Turns the engine died under, left for the partition's "
                                   "next owner to resume", registry=registry)
        self.preempted = Counter("worker_preempted_turns",
                                 "Running turns stopped to give their slot to a tenant below "
                                 "its share (each continues later)", registry=registry)
        self.ttft = Histogram("worker_ttft_seconds", "Prompt taken to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = LoopHistogram("worker_inter_token_seconds",
                                 "Time between tokens of a sequence", LATENCY_BUCKETS, registry)
        self.dead_letters = Counter("worker_dead_letters", "Records sent to the dead-letter topic",
                                    registry=registry)
        self.skipped = Counter("worker_skipped_prompts",
                               "Prompts not run: void (a racing turn came first), duplicate, "
                               "or another model's (other_model)",
                               ["verdict"], registry=registry)
        self.unstarted = Counter("worker_unstarted_turns",
                                 "Turns ended before they started (cancelled, abandoned, "
                                 "session deleted)", registry=registry)
        self.fenced = Counter("worker_fenced",
                              "Transactions refused because this worker left its group",
                              registry=registry)
        self.histories = HistoryMetrics(
            kept=Counter("worker_histories_kept", "Turns whose history this worker kept",
                         registry=registry),
            rebuilt=Counter("worker_histories_rebuilt",
                            "Turns whose history was rebuilt from the log", registry=registry),
            reads=Counter("worker_history_reads", "Records read to rebuild histories",
                          registry=registry),
            mismatches=Counter("worker_history_mismatches",
                               "Histories unlike what their prompt said (logged)",
                               registry=registry))
        Gauge("worker_history_cache_chars", "Characters of history kept",
              registry=registry).set_function(readings.history_chars)
        Gauge("worker_live_records", "chat.live records written", registry=registry
              ).set_function(readings.live_records)


