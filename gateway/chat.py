"""A chat turn: accept it durably, then follow its generation in the log."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway import openai_api
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ChatRequest
from gateway.sessions import SessionStore
from gateway.tail import Delivered, GenerationTail
from pipeline.codec import Position
from pipeline.kafka import EventProducer
from pipeline.settings import GatewaySettings
from pipeline.topics import PROMPTS
from schemas import (
    GenerationCancelled,
    GenerationFailed,
    GenerationFinished,
    GenerationStarted,
    PromptSubmitted,
    TokenDelta,
)

log = logging.getLogger(__name__)

# Failures caused by the request itself; the client gets a 400 for them.
CLIENT_FAILURES = {"context_length_exceeded", "invalid_sampling_params", "invalid_request"}


@dataclass
class Turn:
    """An accepted turn whose generation the gateway is following."""

    prompt: PromptSubmitted
    queue: asyncio.Queue[Delivered]
    created: int = field(default_factory=lambda: int(time.time()))
    accepted_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.prompt.request_id


class ChatService:
    def __init__(
        self,
        settings: GatewaySettings,
        producer: EventProducer,
        tail: GenerationTail,
        sessions: SessionStore,
        metrics: GatewayMetrics,
        models: list[str],
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.tail = tail
        self.sessions = sessions
        self.metrics = metrics
        self.models = models

    def check_limits(self, request: ChatRequest) -> None:
        if request.model not in self.models:
            raise APIError(404, f"The model '{request.model}' does not exist.",
                           code="model_not_found", param="model")
        if len(request.messages) > self.settings.max_messages:
            raise APIError(400, f"At most {self.settings.max_messages} messages per request.",
                           code="too_many_messages", param="messages")
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is not None and max_tokens > self.settings.max_tokens_limit:
            raise APIError(400, f"max_tokens is at most {self.settings.max_tokens_limit}.",
                           code="invalid_value", param="max_tokens")

    async def accept(
        self, request: ChatRequest, session: uuid.UUID | None, tenant: str,
        idempotency_key: str | None,
    ) -> Turn:
        """Write the turn's PromptSubmitted and return once Kafka has acknowledged it."""
        self.check_limits(request)
        history = await self.sessions.history(session, tenant) if session else []
        prompt = PromptSubmitted(
            conversation_id=session or uuid.uuid4(),
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            tenant=tenant,
            model=request.model,
            messages=(*history, *(m.to_event() for m in request.messages)),
            history_len=len(history),
            sampling=request.sampling(),
            idempotency_key=idempotency_key,
        )
        # Subscribe before producing, so no event of this turn can pass unseen.
        turn = Turn(prompt, self.tail.subscribe(prompt.request_id))
        try:
            await asyncio.wait_for(self.producer.send(PROMPTS, prompt), timeout=15)
        except Exception as exc:
            self.tail.unsubscribe(prompt.request_id)
            log.error("could not write prompt %s: %s", prompt.request_id, exc)
            raise APIError(503, "The log is unavailable; the request was not accepted.",
                           code="log_unavailable", headers={"Retry-After": "2"}) from exc
        self.metrics.accepted.inc()
        return turn

    def cancel(self, turn: Turn, reason: str) -> None:
        event = GenerationCancelled(conversation_id=turn.prompt.conversation_id,
                                    request_id=turn.id, tenant=turn.prompt.tenant, reason=reason)
        self.producer.send(PROMPTS, event).add_done_callback(_log_failure)

    async def _events(self, turn: Turn) -> AsyncIterator[Delivered]:
        """The turn's generation events in order, each once, until a terminal one."""
        deadline = turn.accepted_at + self.settings.generation_timeout_s
        next_seq = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                delivered = await asyncio.wait_for(turn.queue.get(), timeout=max(remaining, 0))
            except TimeoutError:
                raise APIError(504, "The generation did not finish in time.",
                               code="generation_timeout") from None
            event = delivered.event
            if isinstance(event, TokenDelta):
                if event.seq < next_seq:
                    continue  # a redelivered duplicate
                if event.seq > next_seq:
                    log.error("gap in %s: expected seq %d, got %d", turn.id, next_seq, event.seq)
                next_seq = event.seq + 1
            yield delivered
            if isinstance(event, (GenerationFinished, GenerationFailed)):
                return

    async def collect(self, turn: Turn) -> dict[str, Any]:
        """Wait for the whole reply (non-streaming)."""
        try:
            async for delivered in self._events(turn):
                event = delivered.event
                if isinstance(event, GenerationFinished):
                    self._observe(turn, event)
                    return openai_api.completion(turn.id, turn.created, turn.prompt.model,
                                                 event.text, event.finish_reason, event.usage)
                if isinstance(event, GenerationFailed):
                    raise _failure_error(event)
        finally:
            self.tail.unsubscribe(turn.id)
        raise AssertionError("unreachable")

    async def stream(self, turn: Turn, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        """The reply as SSE events of OpenAI chunks, ending with ``[DONE]``."""
        model = turn.prompt.model
        ended = False
        self.metrics.active_streams.inc()
        try:
            yield _sse(openai_api.chunk(turn.id, turn.created, model,
                                        {"role": "assistant", "content": ""}))
            async for delivered in self._events(turn):
                event = delivered.event
                if isinstance(event, TokenDelta):
                    if event.text:
                        yield _sse(openai_api.chunk(turn.id, turn.created, model,
                                                    {"content": event.text}), delivered.position)
                elif isinstance(event, GenerationFinished):
                    self._observe(turn, event)
                    reason = openai_api.FINISH_REASONS.get(event.finish_reason, "stop")
                    yield _sse(openai_api.chunk(turn.id, turn.created, model, {}, reason),
                               delivered.position)
                    if include_usage:
                        yield _sse(openai_api.usage_chunk(turn.id, turn.created, model,
                                                          event.usage))
                elif isinstance(event, GenerationFailed):
                    yield _sse(_failure_error(event).body(), delivered.position)
                elif isinstance(event, GenerationStarted):
                    self.metrics.ttft.observe(time.monotonic() - turn.accepted_at)
            ended = True
        except APIError as exc:
            ended = True
            yield _sse(exc.body())
        finally:
            self.metrics.active_streams.dec()
            self.tail.unsubscribe(turn.id)
            if not ended:
                self.cancel(turn, "client disconnected")
        yield {"data": "[DONE]"}

    def _observe(self, turn: Turn, event: GenerationFinished) -> None:
        self.metrics.latency.observe(time.monotonic() - turn.accepted_at)
        self.metrics.completion_tokens.inc(event.usage.completion_tokens)


def _sse(payload: dict[str, Any], position: Position | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"data": json.dumps(payload, separators=(",", ":"))}
    if position is not None:
        event["id"] = f"{position.partition}-{position.offset}"
    return event


def _failure_error(event: GenerationFailed) -> APIError:
    if event.code in CLIENT_FAILURES:
        return APIError(400, event.message, code=event.code)
    return APIError(502, f"The generation failed: {event.message}", code=event.code)


def _log_failure(future: asyncio.Future[Position]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("could not publish a cancellation: %s", future.exception())

