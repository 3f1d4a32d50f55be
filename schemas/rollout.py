"""Model aliases and rollouts: the records of ``chat.rollouts`` and the rules over them
(no I/O).

A client asks for a model by its *alias* (``chat``); workers serve *versions*, each its
own worker group (``--served-model-name chat-v2``). A ``Rollout`` record says, for one
alias, which version serves its turns (``stable``) and, while a rollout runs, which
share of new conversations goes to the ``candidate``. Every change is a new record, so
the topic is the history of every routing change; each turn's own routing decision is
in its ``PromptSubmitted`` (``model``: the version, ``alias``, ``rollout``).

Gateways route by the latest records (``route``); a rollout's health check folds the two
versions' turns (``Health``) and judges the candidate (``judge``). Reading and writing
the records: ``pipeline.rollout``; the command that runs a rollout: ``launch.rollout``.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas import GenerationFailed, GenerationFinished, PromptSubmitted

Status = Literal["running", "promoted", "rolled_back"]
# Failures a version is not to blame for: the request itself was refused.
CLIENT_CAUSED = frozenset({"context_length_exceeded", "invalid_sampling_params",
                           "invalid_request"})


class Figures(BaseModel):
    """One version's ended turns since a rollout started."""

    model_config = ConfigDict(frozen=True)
    turns: int = 0
    failures: int = 0
    ttft_p99_ms: float | None = None

    @property
    def failure_rate(self) -> float:
        return self.failures / self.turns if self.turns else 0.0

    def describe(self) -> str:
        p99 = "-" if self.ttft_p99_ms is None else f"{self.ttft_p99_ms:.0f} ms"
        return f"{self.turns} turns, {self.failures} failed, TTFT p99 {p99}"


class Rollout(BaseModel):
    """Where an alias's turns go. ``since``: the end offsets of ``chat.prompts`` and
    ``chat.generations`` when the rollout started (its health check reads from there)."""

    model_config = ConfigDict(frozen=True)
    alias: str = Field(min_length=1, max_length=200)
    id: str
    stable: str = Field(min_length=1, max_length=200)
    candidate: str | None = None
    share: float = Field(default=0.0, ge=0.0, le=1.0)
    status: Status = "running"
    turns: int = Field(default=50, ge=1)
    since: dict[str, dict[int, int]] = Field(default_factory=dict)
    started_at: float
    updated_at: float
    reason: str = ""
    figures: dict[str, Figures] = Field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "running" and self.candidate is not None

    def route(self, conversation_id: uuid.UUID, live: set[str]) -> str:
        """The version for a new turn of ``conversation_id``: the candidate for a stable
        ``share`` of conversations (the same ones for the whole rollout, so a
        conversation keeps its version and its prefix cache) while it has a live worker;
        the stable version otherwise."""
        if self.running and self.candidate in live and _bucket(self.id, conversation_id) \
                < self.share:
            return self.candidate
        return self.stable


def _bucket(rollout_id: str, conversation_id: uuid.UUID) -> float:
    digest = hashlib.sha256(f"{rollout_id}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64



def stale(known: Rollout | None, record: Rollout) -> bool:
    """Whether ``record`` is a progress record of a rollout whose end ``known`` already
    is. An end is final: a command watching the rollout may have written its progress
    just as another ended it (``--abort``), and that record must not set it running
    again (seen in CI: both watching commands then ran on, blind to the abort)."""
    return (known is not None and known.id == record.id and not known.running
            and record.running)


def newer_rollout(history: list[Rollout], record: Rollout) -> Rollout | None:
    """The latest state of a rollout of ``record``'s alias started after it (ties broken
    by id, so of two started at once exactly one goes on), or None."""
    mine = (record.started_at, record.id)
    newer = [r for r in history if r.alias == record.alias and r.id != record.id
             and (r.started_at, r.id) > mine]
    return newer[-1] if newer else None



def route(book: dict[str, Rollout], model: str, conversation_id: uuid.UUID,
          live: set[str]) -> tuple[str, Rollout | None]:
    """The version for a turn asked for ``model`` (an alias, or a version by its own
    name), and the rollout record that decided it (None: no alias of that name)."""
    record = book.get(model)
    if record is None:
        return model, None
    return record.route(conversation_id, live), record


# -- the health check -----------------------------------------------------------------
@dataclass(frozen=True)
class HealthPolicy:
    """When a candidate is healthy: over its first ``turns`` ended turns, a failure rate
    at most ``max_failure_increase`` above the stable version's over the same time, and
    a TTFT p99 at most ``max_ttft_ratio`` times the stable version's (or
    ``ttft_slack_ms`` above it, whichever is more: a few milliseconds of a fast version
    are noise). Past ``timeout_s`` without enough turns, it is rolled back."""

    turns: int = 50
    max_failure_increase: float = 0.02
    max_ttft_ratio: float = 1.5
    ttft_slack_ms: float = 100.0
    timeout_s: float = 1800.0


class Health:
    """Fold of the log since a rollout started: each version's ended turns."""

    def __init__(self, versions: set[str]) -> None:
        self.versions = versions
        self._version: dict[str, str] = {}  # request id -> version, from its prompt
        self._ended: dict[str, tuple[bool, float | None]] = {}  # request -> failed, TTFT

    def add(self, event: object) -> None:
        if isinstance(event, PromptSubmitted) and event.model in self.versions:
            self._version[event.request_id] = event.model
        elif isinstance(event, GenerationFinished):
            self._ended[event.request_id] = (event.finish_reason == "error", event.ttft_ms)
        elif isinstance(event, GenerationFailed):
            self._ended[event.request_id] = (event.code not in CLIENT_CAUSED, None)

    def figures(self) -> dict[str, Figures]:
        by_version: dict[str, list[tuple[bool, float | None]]] = {v: [] for v in self.versions}
        for request_id, ended in self._ended.items():
            version = self._version.get(request_id)
            if version is not None:
                by_version[version].append(ended)
        return {v: Figures(turns=len(ends), failures=sum(f for f, _ in ends),
                           ttft_p99_ms=p99([t for _, t in ends if t is not None]))
                for v, ends in by_version.items()}


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def judge(stable: Figures, candidate: Figures, policy: HealthPolicy) -> tuple[bool, str]:
    """Whether the candidate is healthy next to the stable version, and why."""
    if candidate.failure_rate > stable.failure_rate + policy.max_failure_increase:
        return False, (f"failure rate {candidate.failure_rate:.1%} against "
                       f"{stable.failure_rate:.1%} (at most +{policy.max_failure_increase:.1%})")
    if candidate.ttft_p99_ms is not None and stable.ttft_p99_ms is not None:
        bound = max(stable.ttft_p99_ms * policy.max_ttft_ratio,
                    stable.ttft_p99_ms + policy.ttft_slack_ms)
        if candidate.ttft_p99_ms > bound:
            return False, (f"TTFT p99 {candidate.ttft_p99_ms:.0f} ms against "
                           f"{stable.ttft_p99_ms:.0f} ms (at most {bound:.0f} ms)")
        ttft = f"TTFT p99 {candidate.ttft_p99_ms:.0f} ms against {stable.ttft_p99_ms:.0f} ms"
    else:
        ttft = "TTFT not compared (the stable version ended no turn meanwhile)"
    return True, (f"failure rate {candidate.failure_rate:.1%} against "
                  f"{stable.failure_rate:.1%}; {ttft}")



def describe(record: Rollout) -> str:
    """One alias's state, for ``pipeline rollout status``."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.updated_at))
    lines = [f"{record.alias}: {record.status}, serving {record.stable}"
             + (f", {record.share:.0%} of new conversations to {record.candidate}"
                if record.running else "") + f" (rollout {record.id}, {when} UTC)"]
    lines += [f"  {version}: {figures.describe()}" for version, figures in
              sorted(record.figures.items())]
    if record.reason:
        lines.append(f"  {record.reason}")
    return "\n".join(lines)
