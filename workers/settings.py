"""The worker's settings (prefix ``WORKER_``)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    # The most prompt and generated tokens one engine step computes. Default: vLLM's.
    # With a CPU build of vLLM, prefills are never split over steps (``engine_args``),
    # and vLLM refuses a value under ``max_model_len``.
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    kv_cache_memory_bytes: int | None = 256 * 2**20
    # How vLLM loads the weights: "dummy" makes them at random from the model's config
    # (no weight files needed: benchmarks on a GPU host, `pipeline bench serving`).
    load_format: Literal["auto", "dummy", "safetensors", "pt"] = "auto"
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = Field(default=1, ge=1)
    enable_prefix_caching: bool = True
    speculative_config: dict[str, Any] | None = None
    # How much to lower the CPU priority (nice) of vLLM's engine processes. They poll
    # without pause; on a host whose CPU also runs the model, they otherwise starve the
    # broker and this worker's own Kafka threads. Default: 10 when vLLM runs on the
    # CPU, 0 (left alone) on accelerators.
    engine_nice: int | None = Field(default=None, ge=0, le=19)
    # Keep this process's own threads (the event loop, vLLM's output processing, the
    # Kafka clients) off the cores vLLM binds its CPU compute threads to, so they do
    # not preempt the model. Default: on when vLLM runs on the CPU.
    isolate_engine_cores: bool | None = None
    # Where vLLM's front end (its output processing: detokenising, stop strings, each
    # request's outputs) runs: "process", a child process of this worker's, which sends
    # it each step's outputs at once (workers/vllm_process.py); "inline", this process;
    # "auto", a process unless vLLM is a CPU build (whose model computes on the cores the
    # second process would take).
    vllm_frontend: Literal["auto", "process", "inline"] = "auto"
    # vLLM handing out nothing for this long while requests run (and the worker reads
    # it) fails them with EngineDead, and the worker exits, so that its partitions go
    # to a worker that serves them: an engine or front end stopped, a GPU hung (a
    # front-end process is killed). A step with no output (a long prompt's prefill)
    # must take less.
    engine_stall_s: float = Field(default=300.0, gt=0)
    metrics_port: int = 0
    # How soon the group notices a dead worker and hands its prompts on.
    session_timeout_ms: int = Field(default=10_000, ge=6_000)
    # A worker handed a partition reads its generations back to its model's oldest
    # unfinished prompt, however old; past this the reading is logged.
    recovery_window_s: float = Field(default=300.0, gt=0)
    # The longest a transaction may stay open. A worker that dies mid-transaction holds
    # back readers of its partitions' generations this long at most.
    transaction_timeout_ms: int = Field(default=10_000, ge=1_000)
    # The producer's transactional id. Empty: one of its own per process. A stable one
    # per worker slot (a StatefulSet ordinal, say) lets a restarted worker fence its
    # predecessor's open transaction at once.
    transactional_id: str = ""
    # A transaction begins at least this long after the previous one: more deltas share
    # each transaction's fixed cost on the broker, for up to this much added latency.
    transaction_interval_ms: float = Field(default=20.0, ge=0, le=1000)
    # Characters of session history kept in memory, so a session's next turn needs not
    # read it back from the log (least recently used first out).
    history_cache_chars: int = Field(default=64 * 2**20, ge=0)
    # Prompts read ahead of the engine, waiting for a slot: the fair share between
    # tenants chooses among those read, so keep it at least the gateways' backlog bound.
    read_ahead: int = Field(default=4096, ge=0)
    # ... and at most this many characters of them.
    read_ahead_chars: int = Field(default=256 * 2**20, ge=0)
    # Which waiting prompt starts next: "fair", a token-weighted fair share between
    # tenants (workers/fairness.py); "fifo", the order they were read in.
    scheduling: Literal["fair", "fifo"] = "fair"
    # Tenants' shares of the engine, as tenant=weight pairs (e.g. "gold=4,free=0.5");
    # a tenant not named weighs 1.
    tenant_weights: str = ""
    # The most turns one tenant may run at once on this worker (unset: every slot).
    # (With preempt off, slots are not taken back from running turns: a cap below
    # max_num_seqs then keeps slots for tenants whose turns come later.)
    max_running_per_tenant: int | None = Field(default=None, ge=1)
    # A prompt's intake (its key fetched, its ledger judged) that takes longer than this
    # is dead-lettered, and its partition's next prompts go on (workers/intake.py).
    intake_timeout_s: float = Field(default=120.0, gt=0)
    # Take a slot back from a running turn of the tenant furthest above its share when a
    # tenant below its share waits (workers/fairness.py); the stopped turn continues
    # later from what it wrote. Only with scheduling "fair".
    preempt: bool = True

    @field_validator("tenant_weights")
    @classmethod
    def _weights_parse(cls, value: str) -> str:
        parse_weights(value)
        return value

    @property
    def weights(self) -> dict[str, float]:
        return parse_weights(self.tenant_weights)

    # The simulated engine: time to first token and per-sequence decode rate.
    sim_ttft_ms: float = Field(default=50.0, ge=0)
    sim_tokens_per_s: float = Field(default=50.0, gt=0)


def parse_weights(text: str) -> dict[str, float]:
    """``tenant=weight,...`` as a dict; ValueError naming what is wrong."""
    weights: dict[str, float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, raw = pair.rpartition("=")
        try:
            weight = float(raw)
        except ValueError:
            weight = math.nan
        if not sep or not tenant or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"'{pair}': each tenant weight is tenant=<a positive number>")
        weights[tenant.strip()] = weight
    return weights
