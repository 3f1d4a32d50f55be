"""What of an event is content: everything a client said or chose in words (messages,
titles, stop strings, the end user it names) and the model's replies, and what would
tell them (the history's digest). The part sealed with the conversation's data key
(``pipeline.sealing``). No I/O.

``content_of`` takes it out as a JSON-ready dict, ``without_content`` leaves the event
with those fields empty, and ``with_content`` puts them back. Records sealed before a
field became content keep it outside the box: opening them leaves it as it was.
"""

from __future__ import annotations

from typing import Any

from schemas.events import (
    ChatMessage,
    EventBase,
    GenerationFinished,
    PromptSubmitted,
    Sealed,
    SessionCreated,
)

Content = dict[str, Any]


def content_of(event: EventBase) -> Content | None:
    """The event's content, or None if it has none."""
    if isinstance(event, PromptSubmitted):
        found: Content = {"messages": [m.content for m in event.messages]}
        if event.history:
            found["history"] = [m.content for m in event.history]
        if event.recalled:
            found["recalled"] = [r.text for r in event.recalled]
        if event.sampling.stop:
            found["stop"] = list(event.sampling.stop)
        if event.history_digest is not None:
            found["history_digest"] = event.history_digest
        if event.user is not None:
            found["user"] = event.user
        return found
    if isinstance(event, GenerationFinished):
        return {"text": event.text}
    if isinstance(event, SessionCreated) and (event.title is not None
                                              or event.memory_user is not None):
        return {"title": event.title, "memory_user": event.memory_user}
    return None


def _messages(messages: tuple[ChatMessage, ...], texts: list[str] | None
              ) -> tuple[ChatMessage, ...]:
    if texts is None or len(texts) != len(messages):
        texts = [""] * len(messages)
    return tuple(m.model_copy(update={"content": t}) for m, t in zip(messages, texts,
                                                                        strict=True))


def with_content(event: EventBase, content: Content | None, sealed: Sealed | None
                 ) -> EventBase:
    """``event`` with ``content`` in its fields (None: emptied) and ``sealed`` set as
    given."""
    emptied = content is None
    content = content or {}
    update: dict[str, Any] = {"sealed": sealed}
    if isinstance(event, PromptSubmitted):
        if emptied or "stop" in content:
            update["sampling"] = event.sampling.model_copy(
                update={"stop": tuple(content.get("stop", ()))})
        for name in ("history_digest", "user"):
            if emptied or name in content:
                update[name] = content.get(name)
        update["messages"] = _messages(event.messages, content.get("messages"))
        if event.history is not None:
            update["history"] = _messages(event.history, content.get("history"))
        if event.recalled:
            texts = content.get("recalled")
            if texts is None or len(texts) != len(event.recalled):
                texts = [""] * len(event.recalled)
            update["recalled"] = tuple(r.model_copy(update={"text": t})
                                       for r, t in zip(event.recalled, texts, strict=True))
    elif isinstance(event, GenerationFinished):
        update["text"] = content.get("text", "")
    elif isinstance(event, SessionCreated):
        update["title"] = content.get("title")
        if emptied or "memory_user" in content:
            update["memory_user"] = content.get("memory_user")
    return event.model_copy(update=update)


def without_content(event: EventBase, sealed: Sealed) -> EventBase:
    return with_content(event, None, sealed)


# Every field of every event, by what it may tell of what a client said (``docs/
# erasure.md``, and the contract's ``x-class``; a test holds this to the models):
SEALED = "sealed"  # in the box: unreadable once the conversation's keys are destroyed
DIGEST = "digest"  # kept as a keyed digest only (``pipeline.digests``)
CHOICE = "choice"  # a number, a flag or a configured name the client chose
SERVER = "server"  # made by the pipeline: ids, times, counts, codes, its own words
LEGACY = "legacy"  # written in the clear by code from before the live stream, never now
_BASE = dict.fromkeys(("v", "event_id", "conversation_id", "request_id", "occurred_at",
                       "tenant", "sealed", "type"), SERVER)
FIELD_CLASSES: dict[str, dict[str, str]] = {
    "PromptSubmitted": {
        **_BASE, "history_end": SERVER, "model": CHOICE, "alias": CHOICE,
        "rollout": SERVER, "messages": SEALED, "history_len": SERVER, "history": SEALED,
        "previous": SERVER, "history_digest": SEALED, "sampling": CHOICE,
        "idempotency_key": DIGEST, "background": CHOICE, "charge": SERVER,
        "memory": CHOICE, "user": SEALED, "recalled": SEALED},
    "SamplingParams": {
        "temperature": CHOICE, "top_p": CHOICE, "top_k": CHOICE, "min_p": CHOICE,
        "presence_penalty": CHOICE, "frequency_penalty": CHOICE,
        "repetition_penalty": CHOICE, "max_tokens": CHOICE,
        "stop": SEALED, "seed": CHOICE, "n": CHOICE, "ignore_eos": CHOICE},
    "SessionCreated": {**_BASE, "title": SEALED, "memory_user": SEALED},
    "SessionDeleted": {**_BASE, "reason": SERVER},
    "GenerationCancelled": {**_BASE, "reason": SERVER},
    "ClientDetached": {**_BASE, "attachment": SERVER, "grace_s": SERVER},
    "ClientAttached": {**_BASE, "attachment": SERVER},
    "MemoryForgotten": {**_BASE, "user": DIGEST},
    "GenerationStarted": {**_BASE, "ref": SERVER, "model": SERVER, "worker": SERVER,
                          "attempt": SERVER, "reply_seq": SERVER, "prompt_tokens": SERVER},
    "GenerationFinished": {
        **_BASE, "ref": SERVER, "model": SERVER, "attempt": SERVER, "reply_seq": SERVER,
        "finish_reason": SERVER, "text": SEALED, "usage": SERVER, "deltas": SERVER,
        "ttft_ms": SERVER, "duration_ms": SERVER},
    "GenerationFailed": {**_BASE, "ref": SERVER, "attempt": SERVER, "code": SERVER,
                         "message": SERVER},
    "TokenDelta": {**_BASE, "attempt": SERVER, "seq": SERVER, "text": LEGACY,
                   "token_ids": LEGACY},
}
