"""The gateway's settings (prefix ``GATEWAY_``)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.settings import CommaList


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    # Gateway processes sharing the port (``pipeline gateway --workers N``): one host's
    # cores serving one address. Each is a whole gateway; they share nothing.
    workers: int = Field(default=1, ge=1, le=64)
    # How long a request waits for the projection to reach the log's end for its
    # conversation before answering 503 (read-your-writes barrier).
    projection_wait_s: float = Field(default=10.0, gt=0)
    # How long any one call to Kafka or PostgreSQL may take before the request is refused
    # (503 with Retry-After): the gateway answers within bounded time when either is away.
    dependency_timeout_s: float = Field(default=5.0, gt=0)
    # How long a read (GET) may take to start its answer, all its calls to Kafka and
    # PostgreSQL together: past it, 503 with Retry-After (gateway/middleware.py). Longer
    # than projection_wait_s, which a read may spend waiting alone.
    answer_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    # How long a starting gateway waits for Kafka to answer before it gives up.
    startup_timeout_s: float = Field(default=120.0, gt=0)
    # How long a new turn may wait for the log to take its prompt. A prompt not in a
    # committed transaction by then is never written: the answer is 503, and the turn
    # never runs.
    accept_timeout_s: float = Field(default=10.0, gt=0)
    # The least time between the starts of two of the prompt writer's transactions (0:
    # back to back). Each transaction costs the broker the same round trips however few
    # prompts it holds; a floor puts more prompts in each and adds up to that much to
    # the time a turn waits to be accepted.
    transaction_interval_ms: float = Field(default=0.0, ge=0, le=1000)
    # How long a request waits for its generation to finish, all told.
    generation_timeout_s: float = Field(default=300.0, gt=0)
    # A session's prompt names its history by its previous turn; every this many turns
    # it carries the history whole instead, so a worker that has not kept it reads at
    # most this many turns back (workers.history). Sessions shorter than this never do.
    history_inline_every: int = Field(default=32, ge=2)
    # A session read folds in the records the projector has not stored yet: past this
    # many in one topic of its partition, the request is refused (503 store_lagging)
    # rather than read them all.
    max_unprojected: int = Field(default=10_000, ge=100)
    max_body_bytes: int = Field(default=1_000_000, ge=1024)
    max_messages: int = Field(default=256, ge=1)
    max_tokens_limit: int = Field(default=32_768, ge=1)
    # The model names the workers serve (what /v1/models lists before any worker is up);
    # GATEWAY_MODELS=a,b in the environment.
    models: CommaList = Field(default_factory=lambda: ["tiny-random-llama"], min_length=1)
    # When every client of a turn has gone away, the worker stops it after this long
    # unless one comes back (through any gateway). Requests with "background": true
    # keep running regardless.
    # The memory service (``pipeline memory``) a turn with ``memory`` recalls from, and
    # how long a recall may take before the turn is refused (503). Unset: no memory.
    memory_url: str | None = None
    memory_timeout_s: float = Field(default=5.0, gt=0)
    cancel_grace_s: float = Field(default=10.0, ge=0)
    # Admission: refuse new turns (429) while the workers' backlog (prompts accepted and
    # not yet started: a running turn is no backlog however long it runs) is over this
    # bound.
    max_backlog: int = Field(default=2048, ge=1)
    # Per tenant (429 naming the cap past it): prompts waiting for the workers, turns
    # running (both as the workers' heartbeats tell, a few seconds late; unset: no cap),
    # and streams open on this gateway.
    max_waiting_per_tenant: int | None = Field(default=1024, ge=1)
    max_running_per_tenant: int | None = Field(default=None, ge=1)
    max_streams_per_tenant: int = Field(default=2000, ge=1)
    # Sessions a tenant may delete per erasure window (PIPELINE_ERASURE_WINDOW_MS): every
    # process holds the erasures of two windows, and reads them at its start, so one
    # tenant deleting without end would make every start and process larger. 0: no cap.
    max_erasures_per_tenant: int = Field(default=20_000, ge=0)
    # A slow client's stream is dropped past this many queued events or bytes of text
    # (consecutive deltas merge first); it resumes with Last-Event-ID.
    stream_max_items: int = Field(default=1000, ge=8)
    stream_max_bytes: int = Field(default=4_000_000, ge=1024)
    # A stream whose client has read nothing for this long (its send blocked) is dropped.
    send_timeout_s: float = Field(default=30.0, gt=0)
    # A request's line and headers must all come within this of its first byte (or of
    # the connection opening), and its body within body_timeout_s of its headers: else
    # 408 and the connection closes (gateway/connections.py).
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # An idle kept-alive connection is closed after this long: longer than its clients'
    # and proxies' own idle timeouts (nginx's and AWS load balancers' 60 s), so the
    # gateway never closes a connection as they send on it. (uvicorn's 5 s did: a client
    # slow to reuse a connection got a reset instead of an answer.)
    keep_alive_s: int = Field(default=75, ge=1, le=3600)
    # Connections one client address may hold open at once on a gateway process (a
    # trusted proxy's are not counted: it bounds its own clients); past it, 429.
    max_connections_per_address: int = Field(default=512, ge=1)
    # Stop reading a generations partition this long after its last stream ended.
    tail_linger_s: float = Field(default=60.0, ge=0)
    # API keys: required when set, and in any case as soon as one key exists.
    require_auth: bool = False
    # Incorrect API keys one client address may present per 10 s before it gets 429
    # without a lookup (keys made up at random would each cost the store a query).
    failed_key_lookups: int = Field(default=20, ge=1)
    # On SIGTERM the gateway stops taking requests and lets open streams run this long
    # before it closes them (their clients resume elsewhere with Last-Event-ID). A pod's
    # termination grace should be longer (deploy/helm: drainSeconds).
    drain_s: int = Field(default=10, ge=0, le=3600)
    # Serve /metrics on this address instead of the API's (port 0: on the API's).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # Host names (the Host header) answered besides the loopback names and ``host``:
    # comma-separated; "*.example.com" matches its subdomains, "*" any name.
    allowed_hosts: CommaList = Field(default_factory=list)
    # Proxies (addresses or networks, comma-separated: "10.0.0.0/8,127.0.0.1") whose
    # Forwarded or X-Forwarded-For header names the client. A request from any other
    # address is its own client, whatever it sends: per-address limits (wrong keys) then
    # hold per client behind an ingress, and no client can pick its address.
    trusted_proxies: CommaList = Field(default_factory=list)

    @model_validator(mode="after")
    def _answer_after_projection(self) -> GatewaySettings:
        if self.answer_timeout_s <= self.projection_wait_s:
            raise ValueError(
                f"GATEWAY_ANSWER_TIMEOUT_S ({self.answer_timeout_s:g}) must be longer than "
                f"GATEWAY_PROJECTION_WAIT_S ({self.projection_wait_s:g}): a read may wait "
                "that long for the projection alone")
        return self

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an address or a network (10.0.0.0/8, "
                                 "127.0.0.1, fd00::/8)") from None
        return entries
