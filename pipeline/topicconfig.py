"""The topics' settings as the cluster has them, checked against what the record needs.

``pipeline topics`` makes the topics with the pipeline's settings, and keeps a topic
that exists as it is. A topic made some other way (by hand, by a broker that creates
topics a client names, by an earlier version) may have settings that lose records
without a word: ``chat.keys`` deleting keys after the broker's default 7 days leaves
every older conversation unreadable; a conversation topic compacted keeps one record per
conversation; ``chat.erasures`` kept for less time than a destroyed key's record makes an
erased conversation readable again. Nothing would show it until the records are gone.

* ``hazards``: the settings that lose records, or bring back erased ones, or keep the
  durable record for less time than this process is told it is kept
  (``PIPELINE_RETENTION_MS``, forever by default). Every process's start refuses them
  (``check``), in one line that says what to do: ``pipeline topics --fix``.
* ``drift``: every setting that differs from what ``pipeline topics`` would make
  (``pipeline.topics.topic_specs``), for ``pipeline topics`` to show, and to set with
  ``--fix`` where that keeps at least as much as before (``fixable``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pipeline.kafka import broker_setting, topic_configs, topic_names
from pipeline.keylimits import KeyringError
from pipeline.topics import (
    BROKER_TIME,
    CONTROL,
    CONVERSATION_TOPICS,
    ERASURES,
    KEYS,
    LIVE,
    ROLLOUTS,
    ROTATIONS,
    WRITER_TIMED,
    TopicPolicy,
    TopicSpec,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class Retrying(Protocol):
    """Asks ``call`` again while a leader moves (``Keyring._retrying``)."""

    def __call__(self, call: Callable[[], T]) -> T: ...


Configs = Mapping[str, Mapping[str, str]]
FOREVER = -1
# Settings that decide how long a topic keeps records: ``--fix`` never lowers them.
KEEPING = ("retention.ms", "retention.bytes", "max.message.bytes")
# Left to the operator: raising it on a topic with fewer replicas stops every write.
BY_HAND = ("min.insync.replicas",)
# Less than a year of a group's offsets kept after its last member left is said at start.
OFFSETS_KEPT_MIN = 365 * 24 * 60
# chat.erasures kept past this many erasure windows is said at start: every start reads
# it whole.
ERASURES_KEPT_MAX = 4
BROKER_TIME_TYPE = BROKER_TIME["message.timestamp.type"]
ADVICE = "`pipeline topics --fix` sets what the pipeline needs (docs/deploying.md, \"Topics\")"


@dataclass(frozen=True)
class Finding:
    topic: str
    setting: str
    have: str
    want: str  # what the pipeline makes, or needs
    why: str = ""  # set for a hazard: what it would lose

    def __str__(self) -> str:
        said = f"{self.topic} has {self.setting}={self.have} (the pipeline's: {self.want})"
        return f"{said}: {self.why}" if self.why else said


def _policies(settings: Mapping[str, str]) -> set[str]:
    return {p.strip() for p in settings.get("cleanup.policy", "delete").split(",")}


def _int(settings: Mapping[str, str], name: str) -> int:
    try:
        return int(settings.get(name, FOREVER))
    except ValueError:
        return FOREVER


def _ages(settings: Mapping[str, str]) -> bool:
    """Whether the topic deletes records by age or size."""
    return "delete" in _policies(settings) and (
        _int(settings, "retention.ms") != FOREVER or _int(settings, "retention.bytes") != FOREVER)


def _days(ms: int) -> str:
    return f"{ms / 86_400_000:g} d" if ms >= 86_400_000 else f"{ms / 3_600_000:g} h"


class TopicsRefused(KeyringError):
    """The topics refuse this process: one it needs is missing, or their settings would
    lose what it writes (``hazards``)."""


def _shorter(have: int, want: int) -> bool:
    """Whether a retention of ``have`` keeps less than one of ``want`` (-1: forever)."""
    return have != FOREVER and (want == FOREVER or have < want)


def hazards(configs: Configs, policy: TopicPolicy) -> list[Finding]:
    """The settings of ``configs`` (a topic's settings by its name; a topic missing is not
    looked at) that lose records or bring back erased ones, for a process with this
    ``policy``: the durable record's retention it was told (``PIPELINE_RETENTION_MS``,
    ``PIPELINE_RETENTION_BYTES``), and the erasure window it keeps erasures for (twice
    it, ``PIPELINE_ERASURE_WINDOW_MS``)."""
    found = []
    window_ms = policy.erasure_window_ms
    for topic in (*CONVERSATION_TOPICS, ROLLOUTS):
        settings = configs.get(topic)
        if settings is None:
            continue
        if "compact" in _policies(settings):
            found.append(Finding(topic, "cleanup.policy", settings["cleanup.policy"], "delete",
                                 "compaction keeps one record per key, and deletes the "
                                 "rest of each conversation's record"))
        wants = ((FOREVER, FOREVER) if topic == ROLLOUTS
                 else (policy.retention_ms, policy.retention_bytes))
        for name, want in zip(("retention.ms", "retention.bytes"), wants, strict=True):
            if _shorter(_int(settings, name), want):
                found.append(Finding(
                    topic, name, settings.get(name, ""), str(want),
                    "the durable record would be deleted sooner than this process is told "
                    "(PIPELINE_RETENTION_MS, PIPELINE_RETENTION_BYTES; forever by default): "
                    "if that is meant, give every process the topic's value"))
    for topic, what in ((KEYS, "every conversation's key, so its content,"),
                        (ROTATIONS, "where rotations wrote keys anew, so keys they moved,")):
        settings = configs.get(topic)
        if settings is not None and _ages(settings):
            found.append(Finding(
                topic, "cleanup.policy", settings.get("cleanup.policy", ""), "compact",
                f"{what} is deleted after retention.ms={settings.get('retention.ms')} or "
                f"past retention.bytes={settings.get('retention.bytes')}, and lost"))
        elif topic == KEYS and settings is not None and "compact" not in _policies(settings):
            found.append(Finding(topic, "cleanup.policy", settings.get("cleanup.policy", ""),
                                 "compact", "a destroyed key's record is never deleted"))
    keys = configs.get(KEYS, {})
    # How long a destroyed key's record may stay: the erasure window where chat.keys
    # does not say (a topic not compacted is refused above, and fixed to it).
    lag = window_ms
    if "compact" in _policies(keys):
        lag = max(_int(keys, "max.compaction.lag.ms"), _int(keys, "segment.ms"))
    if lag == FOREVER or lag > window_ms:
        found.append(Finding(
            KEYS, "max.compaction.lag.ms", keys.get("max.compaction.lag.ms", ""),
            f"{window_ms} (and segment.ms)",
            f"a destroyed key's record may stay {_days(lag) if lag > 0 else 'forever'}, "
            f"longer than processes keep its erasure (the erasure window, "
            f"{_days(window_ms)}): an erased conversation would read again"))
        lag = window_ms  # what --fix sets
    erasures = configs.get(ERASURES)
    if erasures is not None and _ages(erasures):
        kept, size = _int(erasures, "retention.ms"), _int(erasures, "retention.bytes")
        why = (f"an erasure may go before the records of the keys it names (up to "
               f"{_days(lag)}): an erased conversation would read again after a restart")
        if kept != FOREVER and kept < 2 * lag:
            found.append(Finding(ERASURES, "retention.ms", str(kept), str(2 * lag), why))
        if size != FOREVER:
            found.append(Finding(ERASURES, "retention.bytes", str(size), str(FOREVER), why))
    return found


def _same(setting: str, have: str, want: str) -> bool:
    if setting == "cleanup.policy":
        return {p.strip() for p in have.split(",")} == {p.strip() for p in want.split(",")}
    return have == want


def drift(specs: list[TopicSpec], configs: Configs) -> list[Finding]:
    """Each setting a topic of ``specs`` that exists has other than its spec's."""
    return [Finding(spec.name, name, have, want)
            for spec in specs if spec.name in configs
            for name, want in spec.config.items()
            if (have := configs[spec.name].get(name)) is not None
            and not _same(name, have, want)]


def fixable(finding: Finding) -> bool:
    """Whether ``--fix`` sets it: not a setting it would lower how much a topic keeps
    (that deletes records: the operator's to do), nor one left to the operator."""
    if finding.setting in BY_HAND:
        return False
    if finding.setting in KEEPING:
        have, want = int(finding.have), int(finding.want)
        return have != FOREVER and (want == FOREVER or want > have)
    return True


def check(bootstrap: str, policy: TopicPolicy, retrying: Retrying = lambda call: call(),
          refuse: bool = True) -> None:
    """``TopicsRefused`` if a pipeline topic's settings lose records or bring back erased
    ones (``hazards``; only said if not ``refuse``); a warning for what costs without
    losing (``warnings``). A topic the cluster does not describe (an ACL) is not
    checked, and said."""
    topics = [*CONVERSATION_TOPICS, LIVE, ROLLOUTS, KEYS, ROTATIONS, ERASURES]
    configs = retrying(lambda: topic_configs(bootstrap, topics))
    found = hazards(configs, policy)
    if found and refuse:
        raise TopicsRefused("; ".join(map(str, found)) + f". {ADVICE}")
    for finding in found:
        log.warning("%s. %s", finding, ADVICE)
    for warning in warnings(bootstrap, configs, policy):
        log.warning("%s", warning)


def warnings(bootstrap: str, configs: Configs, policy: TopicPolicy) -> list[str]:
    """What the cluster has that costs the pipeline, without losing records."""
    said = []
    kept_ms = _int(configs.get(ERASURES, {}), "retention.ms")
    if ERASURES in configs and (kept_ms == FOREVER
                                or kept_ms > ERASURES_KEPT_MAX * policy.erasure_window_ms):
        said.append(
            f"{ERASURES} keeps erasures {'forever' if kept_ms == FOREVER else _days(kept_ms)} "
            f"(retention.ms), and every process reads them all at its start: the pipeline "
            f"needs twice the erasure window ({_days(2 * policy.erasure_window_ms)}). Lower "
            "it by hand once chat.keys has been compacted within the window for a window "
            "(docs/deploying.md)")
    timed = {topic: settings.get("message.timestamp.type") for topic, settings in configs.items()}
    if by_writer := sorted(t for t, kind in timed.items()
                           if t not in WRITER_TIMED and kind not in (None, BROKER_TIME_TYPE)):
        said.append(
            f"{', '.join(by_writer)} take each record's time from its writer's clock "
            f"(message.timestamp.type={timed[by_writer[0]]}): a writer whose clock is an "
            f"hour ahead has its records refused (Kafka 4's message.timestamp.after.max.ms), "
            f"every transaction they are in aborted; and {CONTROL} counts a client's "
            f"departure from when it was written, not from when it reached the log. {ADVICE}")
    if by_broker := sorted(t for t, kind in timed.items()
                           if t in WRITER_TIMED and kind == BROKER_TIME_TYPE):
        said.append(
            f"{', '.join(by_broker)} take each record's time from the broker "
            f"(message.timestamp.type={BROKER_TIME_TYPE}): a turn's records are found by "
            f"its worker's times, so streams resumed from a turn's start on a worker whose "
            f"clock runs 2 s ahead of the brokers would begin after its first tokens. "
            f"{ADVICE}")
    kept = broker_setting(bootstrap, "offsets.retention.minutes")
    if kept is not None and kept.isdigit() and int(kept) < OFFSETS_KEPT_MIN:
        said.append(
            f"the brokers keep a consumer group's offsets {int(kept) / 1440:g} days after its "
            "last member left (offsets.retention.minutes): a projector or a model's workers "
            "all stopped longer start again from the log's start. Set it to years "
            "(docs/deploying.md)")
    return said


def require(bootstrap: str, topics: Sequence[str]) -> None:
    """``TopicsRefused`` unless every one of ``topics`` exists: a client that reads a
    topic that does not exist may have the broker make it, with the broker's settings
    (aiokafka's does, where the broker makes topics clients name)."""
    missing = sorted(set(topics) - set(topic_names(bootstrap)))
    if missing:
        raise TopicsRefused(f"the topics {', '.join(missing)} do not exist: `pipeline "
                            "topics` makes the pipeline's")
