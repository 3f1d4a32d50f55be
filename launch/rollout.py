"""``pipeline rollout``: start (or resume) a rollout of a model alias, watch the two
versions' turns in the log from its start (``schemas.rollout.Health``), and promote the
candidate or roll it back (``schemas.rollout.judge``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.codec import DecodeError, parse
from pipeline.kafka.plain import PlainReader
from pipeline.rollout import RolloutBook, publish
from pipeline.roster import Roster
from pipeline.topics import GENERATIONS, PROMPTS
from schemas.rollout import Figures, Health, HealthPolicy, Rollout, judge, newer_rollout


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
                        health.add(parse(msg.value))  # ids and counts only
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


