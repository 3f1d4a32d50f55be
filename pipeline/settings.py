"""Typed settings, one environment prefix per service, read once in ``main``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class CommonSettings(BaseSettings):
    """Where the log and the store are. Prefix ``PIPELINE_``, and ``DATABASE_URL``."""

    model_config = SettingsConfigDict(env_prefix="PIPELINE_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:55432/pipeline",
        validation_alias="DATABASE_URL",
    )
    partitions: int = Field(default=6, ge=1)
    state_dir: Path = REPO_ROOT / ".state"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    # How long a request waits for the projection to reach the log's end for its
    # conversation before answering 503 (read-your-writes barrier).
    projection_wait_s: float = Field(default=10.0, gt=0)
    # How long a request waits for its generation to finish, all told.
    generation_timeout_s: float = Field(default=300.0, gt=0)
    max_body_bytes: int = Field(default=1_000_000, ge=1024)
    max_messages: int = Field(default=256, ge=1)
    max_tokens_limit: int = Field(default=32_768, ge=1)
    # The model names the workers serve, comma-separated (what /v1/models lists).
    models: str = "tiny-random-llama"
    # When every client of a turn has gone away, the worker stops it after this long
    # unless one comes back (through any gateway). Requests with "background": true
    # keep running regardless.
    cancel_grace_s: float = Field(default=10.0, ge=0)
    # Admission: refuse new turns (429) while the workers' backlog (prompts accepted but
    # not finished, running ones included) is over this bound.
    max_backlog: int = Field(default=2048, ge=1)
    # A slow client's stream is dropped past this many queued events or bytes of text
    # (consecutive deltas merge first); it resumes with Last-Event-ID.
    stream_max_items: int = Field(default=1000, ge=8)
    stream_max_bytes: int = Field(default=4_000_000, ge=1024)
    # Stop reading a generations partition this long after its last stream ended.
    tail_linger_s: float = Field(default=60.0, ge=0)
    # API keys: required when set, and in any case as soon as one key exists.
    require_auth: bool = False
    # Serve /metrics on this address instead of the API's (port 0: on the API's).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # Host names (the Host header) answered besides the loopback names and ``host``:
    # comma-separated; "*.example.com" matches its subdomains, "*" any name.
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) \
            else value


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore")

    # "vllm", or "sim": a SIMULATED engine for load and fault tests (no model).
    engine: Literal["vllm", "sim"] = "vllm"
    # A Hugging Face model directory. Empty: make (once) and serve the tiny random model.
    model: str = ""
    served_model_name: str = ""
    dtype: str = "float32"
    # Defaults: 32 for vLLM, 256 for the simulated engine.
    max_num_seqs: int | None = Field(default=None, ge=1)
    # Default: 512 for the tiny model, the model's own otherwise.
    max_model_len: int | None = Field(default=None, ge=16)
    kv_cache_memory_bytes: int | None = 256 * 2**20
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    # Token coalescing: one TokenDelta per request per N ms window, the windows shared
    # by all turns (the first token always goes at once); 0 emits one per engine step
    # per request.
    coalesce_ms: float = Field(default=10.0, ge=0)
    # How much to lower the CPU priority (nice) of vLLM's engine processes. They poll
    # without pause; on a host whose CPU also runs the model, they otherwise starve the
    # broker and this worker's own Kafka threads. Default: 10 when vLLM runs on the
    # CPU, 0 (left alone) on accelerators.
    engine_nice: int | None = Field(default=None, ge=0, le=19)
    # Keep this process's own threads (the event loop, vLLM's output processing, the
    # Kafka clients) off the cores vLLM binds its CPU compute threads to, so they do
    # not preempt the model. Default: on when vLLM runs on the CPU.
    isolate_engine_cores: bool | None = None
    metrics_port: int = 0
    # How soon the group notices a dead worker and hands its prompts on.
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    # How far back a worker looks for unfinished turns when handed a partition:
    # at least the longest a generation may take.
    recovery_window_s: float = Field(default=300.0, gt=0)
    # The longest a transaction may stay open. A worker that dies mid-transaction holds
    # back readers of its partitions' generations this long at most.
    transaction_timeout_ms: int = Field(default=10_000, ge=1_000)
    # The producer's transactional id. Empty: one of its own per process. A stable one
    # per worker slot (a StatefulSet ordinal, say) lets a restarted worker fence its
    # predecessor's open transaction at once.
    transactional_id: str = ""
    # The simulated engine: time to first token and per-sequence decode rate.
    sim_ttft_ms: float = Field(default=50.0, ge=0)
    sim_tokens_per_s: float = Field(default=50.0, gt=0)


class ProjectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PROJECTOR_", extra="ignore")

    # The consumer group, one per store: a second store fed from the same log (a
    # reporting copy, say) runs its projectors in a group of its own.
    group: str = "projector"

    batch_max_events: int = Field(default=500, ge=1)
    batch_max_ms: float = Field(default=50.0, gt=0)
    # How soon the group notices a dead projector and hands its partitions on.
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    metrics_port: int = 0
