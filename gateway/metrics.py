"""The gateway's Prometheus metrics, on a registry the app owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pipeline.metrics import LATENCY_BUCKETS


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("gateway_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=registry)
        self.accepted = Counter("gateway_turns_accepted",
                                "Turns whose prompt Kafka acknowledged", registry=registry)
        self.accept_timeouts = Counter(
            "gateway_accept_timeouts", "New turns refused because the steps before their "
            "commit outlasted GATEWAY_ACCEPT_TIMEOUT_S (never written)", registry=registry)
        self.routed = Counter("gateway_routed_turns",
                              "Accepted turns asked for a model alias, by the version that "
                              "serves them", ["alias", "version"], registry=registry)
        self.active_streams = Gauge("gateway_active_streams", "Open SSE streams",
                                    registry=registry)
        self.ttft = Histogram("gateway_ttft_seconds",
                              "From prompt acknowledged to GenerationStarted seen",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.memory_recall = Histogram("gateway_memory_recall_seconds",
                                       "Recalling a user's memories for a turn (before its "
                                       "prompt is written: added to its TTFT)",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("gateway_generation_seconds",
                                 "From prompt acknowledged to GenerationFinished seen",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.streamed_tokens = Counter("gateway_streamed_tokens",
                                       "Tokens delivered to clients (rate it for tokens/s)",
                                       registry=registry)
        self.active_sessions = Gauge("gateway_active_sessions",
                                     "Sessions with a stream open in this process",
                                     registry=registry)
        self.backlog = Gauge("gateway_backlog",
                             "Prompts accepted and not yet finished by the workers "
                             "(consumer lag of group workers)", registry=registry)
        self.rejected = Counter("gateway_rejected", "Requests refused before acceptance",
                                ["code"], registry=registry)
        self.rate_limit_refusals = Counter(
            "gateway_rate_limit_refusals", "Charges refused for a key's rate limit, by who "
            "refused: here (no store query) or the store", ["by"], registry=registry)
        self.connections_refused = Counter(
            "gateway_connections_refused", "Connections closed before the app saw a request: "
            "header_timeout, body_timeout (408), per_address (429), malformed (400)", ["reason"],
            registry=registry)
        self.idempotent_replays = Counter("gateway_idempotent_replays",
                                          "Retried requests answered with their original turn",
                                          registry=registry)
        self.prompt_transactions = Gauge(
            "gateway_prompt_transactions",
            "Kafka transactions committed with accepted prompts (each costs the broker "
            "the same round trips however many prompts it holds)", registry=registry)
        self.broker_clock_ahead = Gauge(
            "gateway_broker_clock_ahead_seconds",
            "The Kafka brokers' clock less this host's, read off the prompts it writes: "
            "keep it within 60 s either way", registry=registry)
        self.log_reads = Counter(
            "gateway_log_read_records", "Records read from the log for requests (session "
            "views, resumes, a turn sent again), by topic: bounded by each request's own "
            "turn or session, never by the partition", ["topic"], registry=registry)
        self.tailed_partitions = Gauge("gateway_tailed_partitions",
                                       "Generation partitions this process reads",
                                       registry=registry)
        self.stream_refills = Counter(
            "gateway_stream_refills", "Turns read again from the log for a client because "
            "their live items came with a gap", registry=registry)
        self.stream_gaps = Counter(
            "gateway_stream_gaps", "Gaps a client's stream was sent with: the log lacked the "
            "deltas too, or could not be read", registry=registry)
        self.tail_rereads = Gauge(
            "gateway_tail_rereads",
            "Tailed partitions read again since start because they had records to read "
            "and read none for 10 s (a fetch that stopped)", registry=registry)
