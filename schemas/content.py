"""What of an event is content (what its users said, the model's replies, titles): the
part sealed with the conversation's data key (``pipeline.sealing``). No I/O.

``content_of`` takes it out as a JSON-ready dict, ``without_content`` leaves the event
with those fields empty, and ``with_content`` puts them back.
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
        return found
    if isinstance(event, GenerationFinished):
        return {"text": event.text}
    if isinstance(event, SessionCreated) and event.title is not None:
        return {"title": event.title}
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
    content = content or {}
    update: dict[str, Any] = {"sealed": sealed}
    if isinstance(event, PromptSubmitted):
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
    return event.model_copy(update=update)


def without_content(event: EventBase, sealed: Sealed) -> EventBase:
    return with_content(event, None, sealed)
