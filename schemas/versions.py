"""Upcasters: each brings one event type's JSON from one version to the next.

``CURRENT[type]`` is the version this code writes; ``upcast`` applies the chain from
an event's ``v`` up to it. An event newer than this code knows is taken as it is:
versions only add optional fields, which a tolerant reader keeps without knowing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.events import EventBase

JSON = dict[str, Any]
Upcaster = Callable[[JSON], JSON]


def _prompt_v1_to_v2(data: JSON) -> JSON:
    # v1 prompts carry no history position: none of them can be void.
    return {**data, "history_end": None, "v": 2}


def _prompt_v2_to_v3(data: JSON) -> JSON:
    # v2 prompts were routed by nothing: the model asked for is the one that served.
    return {**data, "alias": None, "rollout": None, "v": 3}


def _prompt_v3_to_v4(data: JSON) -> JSON:
    # v3 prompts repeat the session: its first ``history_len`` messages are the history,
    # given inline.
    messages, known = data.get("messages"), data.get("history_len", 0)
    if isinstance(messages, list) and type(known) is int and known > 0:
        return {**data, "history": messages[:known], "messages": messages[known:], "v": 4}
    return {**data, "v": 4}


def _deltas_in_this_topic(data: JSON) -> JSON:
    # v1 of a generation's start and end: its deltas are TokenDelta events beside them.
    return {**data, "ref": None, "v": 2}


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("PromptSubmitted", 1): _prompt_v1_to_v2,
    ("PromptSubmitted", 2): _prompt_v2_to_v3,
    ("PromptSubmitted", 3): _prompt_v3_to_v4,
    ("SessionDeleted", 1): lambda data: {**data, "reason": None, "v": 2},
    ("GenerationStarted", 1): _deltas_in_this_topic,
    ("GenerationFinished", 1): _deltas_in_this_topic,
    ("GenerationFailed", 1): _deltas_in_this_topic,
}


def _current_versions() -> dict[str, int]:
    versions = {}
    todo: list[type[EventBase]] = [EventBase]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        type_field = cls.model_fields.get("type")
        if type_field is not None and isinstance(type_field.default, str):
            versions[type_field.default] = int(cls.model_fields["v"].default)
    return versions


CURRENT: dict[str, int] = _current_versions()


def is_current(kind: str, version: int) -> bool:
    return version >= CURRENT.get(kind, version)


def upcast(data: JSON) -> JSON:
    """``data`` brought up to its type's current version (unchanged if it is already)."""
    kind, version = data.get("type"), data.get("v", 1)
    if not isinstance(kind, str) or not isinstance(version, int):
        return data
    while version < CURRENT.get(kind, version):
        step = UPCASTERS.get((kind, version))
        if step is None:
            raise ValueError(f"no upcaster for {kind} v{version}")
        data = step(data)
        version = data["v"]
    return data
