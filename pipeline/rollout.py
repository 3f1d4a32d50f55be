"""Model aliases and rollouts, kept in ``chat.rollouts`` (one partition, kept forever).

A client asks for a model by its *alias* (``chat``); workers serve *versions*, each its
own worker group (``--served-model-name chat-v2``). A ``Rollout`` record says, for one
alias, which version serves its turns (``stable``) and, while a rollout runs, which
share of new conversations goes to the ``candidate``. Every change is a new record, so
the topic is the history of every routing change; each turn's own routing decision is
in its ``PromptSubmitted`` (``model``: the version, ``alias``, ``rollout``).

``pipeline rollout`` (``run_rollout``) starts a rollout, watches the two versions'
turns in the log from its start (``Health``), and promotes the candidate or rolls it
back (``judge``). Gateways read the records (``RolloutBook``) and route (``route``);
nothing else holds routing state, so any number of gateways agree.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.codec import DecodeError, decode
from pipeline.kafka import ProduceError
from pipeline.kafka.plain import BEGINNING, PlainReader, PlainWriter
from pipeline.roster import Roster
from pipeline.topics import GENERATIONS, PROMPTS, ROLLOUTS
from schemas import GenerationFailed, GenerationFinished, PromptSubmitted

log = logging.getLogger(__name__)

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


# -- reading and writing the records ------------------------------------------------
class RolloutBook:
    """The latest record per alias, read from ``chat.rollouts``. ``refresh()`` reads
    what arrived (call it from one thread)."""

    def __init__(self, bootstrap: str) -> None:
        self._reader = PlainReader(bootstrap, "rollouts")
        self._reader.start({(ROLLOUTS, 0): BEGINNING})
        self.latest: dict[str, Rollout] = {}
        self.history: list[Rollout] = []

    def refresh(self) -> dict[str, Rollout]:
        for msg in self._reader.read(1000):
            if msg.value is None:
                continue
            try:
                record = Rollout.model_validate_json(msg.value)
            except ValidationError as exc:
                log.warning("unreadable rollout record at offset %s: %s",
                            msg.position.offset, exc)
                continue
            if stale(self.latest.get(record.alias), record):
                continue
            self.latest[record.alias] = record
            self.history.append(record)
        return dict(self.latest)

    def read_to_end(self, timeout: float = 10.0) -> dict[str, Rollout]:
        """Everything written so far (for a command, not a request path)."""
        high = self._reader.end(ROLLOUTS, 0, timeout)
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            position = self._reader.position(ROLLOUTS, 0)
            if position >= high or (high == 0):
                return dict(self.latest)
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {ROLLOUTS} to its end")
            time.sleep(0.05)

    def close(self) -> None:
        self._reader.close()


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


def publish(bootstrap: str, record: Rollout, timeout: float = 30.0) -> None:
    """Write ``record``; return once it is durable, or raise."""
    writer = PlainWriter(bootstrap, "rollout-writer")
    writer.send(ROLLOUTS, record.alias.encode(), record.model_dump_json().encode())
    failed = writer.flush(timeout)
    if failed:
        raise ProduceError(f"rollout record not acknowledged: {failed[0]}")


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


# -- the command ----------------------------------------------------------------------
class RolloutRefused(Exception):
    """A rollout that cannot start (the message says why)."""


@dataclass
class Controller:
    """``pipeline rollout``: start (or resume) a rollout and see it to its end."""

    bootstrap: str
    say: Callable[[str], None] = print
    progress_every_s: float = 2.0
    publish_every_s: float = 5.0

    def start(self, alias: str, to: str, share: float, policy: HealthPolicy) -> Rollout:
        current = self._current(alias)
        if current is not None and current.running:
            if current.candidate == to:
                self.say(f"resuming the rollout of {alias} to {to} started "
                         f"{time.time() - current.started_at:.0f} s ago")
                return current
            raise RolloutRefused(f"a rollout of {alias} to {current.candidate} is running; "
                                 f"wait for it or end it: pipeline rollout {alias} --abort")
        stable = current.stable if current is not None else alias
        if to == stable:
            raise RolloutRefused(f"{to} already serves {alias}")
        self._wait_live(to)
        now = time.time()
        record = Rollout(alias=alias, id=uuid.uuid4().hex[:12], stable=stable, candidate=to,
                         share=share, turns=policy.turns, since=self._ends(), started_at=now,
                         updated_at=now)
        publish(self.bootstrap, record)
        self.say(f"rollout {record.id}: {share:.0%} of new conversations of {alias} to {to}, "
                 f"the rest to {stable}; health check over {to}'s first {policy.turns} turns")
        return record

    def watch(self, record: Rollout, policy: HealthPolicy) -> Rollout:
        """Fold the two versions' turns until the candidate has ``policy.turns`` of them
        (or the time is up, or someone else ended the rollout), then promote or roll back."""
        assert record.candidate is not None
        health = Health({record.stable, record.candidate})
        reader = PlainReader(self.bootstrap, f"rollout-{record.id}")
        reader.start({(topic, int(p)): offset
                      for topic, ends in record.since.items() for p, offset in ends.items()})
        book = RolloutBook(self.bootstrap)
        said = published = 0.0
        try:
            while True:
                for msg in reader.read(500, 0.5):
                    try:
                        health.add(decode(msg.value))
                    except DecodeError:
                        continue
                figures = health.figures()
                new, old = figures[record.candidate], figures[record.stable]
                now = time.monotonic()
                if now - said >= self.progress_every_s:
                    said = now
                    self.say(f"  {record.candidate}: {min(new.turns, policy.turns)}/"
                             f"{policy.turns} turns, {new.failures} failed, TTFT p99 "
                             f"{_ms(new.ttft_p99_ms)} | {record.stable}: {old.describe()}")
                latest = book.refresh().get(record.alias)
                rival = newer_rollout(book.history, record)
                if rival is not None:
                    # Another command's rollout of the alias, started after this one (two
                    # started at once): the later one goes on, this one stands down. Its
                    # own progress record may have been written over the rival's since:
                    # the rival's is written again, for the gateways to follow.
                    self.say(f"superseded by rollout {rival.id} ({rival.status}); this "
                             "one ends without a verdict")
                    if latest is not None and latest.id == record.id:
                        publish(self.bootstrap, rival)
                    return rival
                if latest is not None and latest.id == record.id and not latest.running:
                    self.say(f"the rollout was ended elsewhere: {latest.status} "
                             f"({latest.reason})")
                    return latest
                if new.turns >= policy.turns:
                    healthy, why = judge(old, new, policy)
                    return self._end(record, figures, healthy, why)
                if time.time() - record.started_at > policy.timeout_s:
                    return self._end(record, figures, False,
                                     f"only {new.turns} of {policy.turns} turns of "
                                     f"{record.candidate} within {policy.timeout_s:.0f} s")
                if now - published >= self.publish_every_s:
                    published = now
                    record = record.model_copy(update={"figures": figures,
                                                       "updated_at": time.time()})
                    book.refresh()
                    if newer_rollout(book.history, record) is None:  # else: next turn
                        publish(self.bootstrap, record)
        finally:
            reader.close()
            book.close()

    def abort(self, alias: str, reason: str = "ended by an operator") -> Rollout:
        current = self._current(alias)
        if current is None or not current.running:
            raise RolloutRefused(f"no rollout of {alias} is running")
        return self._end(current, current.figures, False, reason)

    def _current(self, alias: str) -> Rollout | None:
        book = RolloutBook(self.bootstrap)
        try:
            return book.read_to_end().get(alias)
        finally:
            book.close()

    def _end(self, record: Rollout, figures: dict[str, Figures], healthy: bool,
             why: str) -> Rollout:
        assert record.candidate is not None
        ended = record.model_copy(update={
            "status": "promoted" if healthy else "rolled_back",
            "stable": record.candidate if healthy else record.stable,
            "candidate": None, "share": 0.0, "figures": figures,
            "updated_at": time.time(), "reason": why})
        publish(self.bootstrap, ended)
        verb = f"promoted {record.candidate}" if healthy else f"rolled back to {record.stable}"
        self.say(f"rollout {record.id}: {verb}: {why}")
        return ended

    def _wait_live(self, version: str, timeout: float = 10.0) -> None:
        roster = Roster(self.bootstrap)
        try:
            deadline = time.monotonic() + timeout
            while version not in roster.refresh():
                if time.monotonic() > deadline:
                    raise RolloutRefused(f"no live worker serves {version}: start its workers "
                                         f"(--served-model-name {version}) first")
                time.sleep(0.5)
        finally:
            roster.close()

    def _ends(self) -> dict[str, dict[int, int]]:
        probe = PlainReader(self.bootstrap, "rollout-probe", committed_only=False)
        try:
            return {topic: {p: probe.end(topic, p) for p in probe.partitions(topic)}
                    for topic in (PROMPTS, GENERATIONS)}
        finally:
            probe.close()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


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
