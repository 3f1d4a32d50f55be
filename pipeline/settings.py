"""Typed settings, one environment prefix per service, read once by the ``pipeline``
command (``launch``). Each service owns its own (``gateway.settings``,
``workers.settings``, ``projections.settings``); these are what they all share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pipeline.topics import TopicPolicy

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
    # The local cluster's size (``pipeline infra up --brokers N``).
    brokers: int = Field(default=1, ge=1, le=9)
    # Topic settings: replication (default min(3, brokers)), min.insync.replicas
    # (default 2 with 3 or more replicas), retention of the chat topics (forever by
    # default: they are the system of record) and of the dead-letter topic (14 days).
    replication_factor: int | None = Field(default=None, ge=1)
    min_insync_replicas: int | None = Field(default=None, ge=1)
    retention_ms: int = Field(default=-1, ge=-1)
    retention_bytes: int = Field(default=-1, ge=-1)
    deadletter_retention_ms: int = Field(default=14 * 24 * 3600 * 1000, ge=60_000)
    # How long the live stream (chat.live) keeps a turn's deltas: resuming a stream works
    # that long (after it, a finished turn is sent whole from the durable record).
    live_retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=3600 * 1000)
    # The largest record a chat topic takes (max.message.bytes, and the producers'
    # message.max.bytes). A prompt past it is refused with 413, a reply with a failure.
    max_record_bytes: int = Field(default=8 * 2**20, ge=2**20, le=2**30)
    # How producers compress record batches (the broker keeps them as they come): zstd
    # keeps the durable record near the compressed size of its text.
    compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "zstd"
    state_dir: Path = REPO_ROOT / ".state"
    # Where workers, projectors and analytics serve /metrics (their --metrics-port):
    # loopback by default; 0.0.0.0 in a pod, for Prometheus and the probes.
    metrics_host: str = "127.0.0.1"
    # The key-encryption key that wraps every conversation's data keys (base64 of 32
    # bytes; ``docs/erasure.md``). Every process must have the same. Unset: the one in
    # ``kek_file``, made there on first use (a local stack's processes share it).
    kek: SecretStr | None = None
    kek_file: Path | None = None  # None: <state_dir>/kek
    # During a KEK rotation (``pipeline keys rotate-kek``): the KEKs that wrapped keys
    # before, comma-separated base64, still accepted to unwrap (never to wrap).
    kek_previous: SecretStr | None = None
    # How long a destroyed data key may stay in chat.keys before compaction deletes it.
    erasure_window_ms: int = Field(default=24 * 3600 * 1000, ge=60_000)
    # The data keys a process holds at most (least recently used first out); any other
    # is one fetch away (pipeline.keystore). About 2.7 KB each (an AES-GCM context).
    key_cache: int = Field(default=16_384, ge=16, le=10_000_000)

    def topic_policy(self) -> TopicPolicy:
        return TopicPolicy(self.partitions, self.replication_factor, self.min_insync_replicas,
                           self.retention_ms, self.retention_bytes,
                           self.deadletter_retention_ms, self.live_retention_ms,
                           self.max_record_bytes, self.erasure_window_ms)


def _split_commas(value: Any) -> Any:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) \
        else value


# A list that an environment variable gives as "a,b,c".
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]
