"""Event models of the chat pipeline (no I/O)."""

from schemas.events import (
    EVENT_ADAPTER,
    ChatMessage,
    Event,
    EventIds,
    FinishReason,
    GenerationCancelled,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    SamplingParams,
    TokenDelta,
    Usage,
)

__all__ = [
    "EVENT_ADAPTER",
    "ChatMessage",
    "Event",
    "EventIds",
    "FinishReason",
    "GenerationCancelled",
    "GenerationEvent",
    "GenerationFailed",
    "GenerationFinished",
    "GenerationStarted",
    "PromptSubmitted",
    "SamplingParams",
    "TokenDelta",
    "Usage",
]
