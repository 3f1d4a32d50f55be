"""The memory service's settings (prefix ``MEMORY_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class MemorySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MEMORY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8100
    # The consumer group: a second memory store (a rebuild) reads in a group of its own.
    group: str = "memory"
    # The tables' schema in DATABASE_URL (None: the search path's, beside the store).
    schema_name: str | None = None
    # The embedding model: a model directory or a Hugging Face name (vLLM's pooling
    # runner; a causal model is converted to an embedding model). Unset: the tiny random
    # model made locally, whose vectors rank nothing by meaning (tests and the demo).
    model: str | None = None
    # float32 on CPU, as the worker: vLLM's CPU backend has no fast half-precision path on
    # every processor (oneDNN falls back to torch). "auto" or bfloat16 on a GPU.
    dtype: str = "float32"
    max_model_len: int | None = Field(default=None, ge=16)
    # What vLLM may take for its KV cache on a CPU host (bytes).
    kv_cache_memory_bytes: int = Field(default=256 * 2**20, ge=2**20)
    # A memory is the user's message of a finished turn, cut to this many characters.
    max_memory_chars: int = Field(default=1000, ge=16, le=100_000)
    # A user keeps their newest this many memories: an older one is dropped as a new one
    # comes (recall reads all of a user's memories: this bounds its cost).
    max_memories_per_user: int = Field(default=10_000, ge=1, le=10_000_000)
    # Recalled per turn: ``recall_k`` by default, at most ``max_recall_k``, and at most
    # ``max_recall_chars`` characters in all (the nearest first).
    recall_k: int = Field(default=3, ge=1)
    max_recall_k: int = Field(default=8, ge=1, le=100)
    max_recall_chars: int = Field(default=4000, ge=16)
    # Texts embedded at a time by the consumer: a recall waiting for the engine goes
    # before the consumer's next chunk, so a user's burst of memories delays another
    # user's recall by one chunk at most.
    embed_chunk: int = Field(default=16, ge=1, le=1024)
    # Recalls run pool_size at once; the others wait in a queue per tenant, served in
    # turn, and a tenant with this many waiting gets 429 for the next (memory/recalls.py).
    max_waiting_recalls_per_tenant: int = Field(default=32, ge=1)
    # Connections to PostgreSQL (the API's calls and the consumer's batches share them).
    pool_size: int = Field(default=8, ge=2, le=100)
    # An API call's whole time (its wait for a connection and its queries): past it, or
    # with the database away, the call is answered 503 (the gateway's own timeout,
    # GATEWAY_MEMORY_TIMEOUT_S, is 5 s by default).
    request_timeout_s: float = Field(default=4.0, gt=0)
    batch_max_events: int = Field(default=200, ge=1)
    batch_max_ms: float = Field(default=50.0, gt=0)
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
