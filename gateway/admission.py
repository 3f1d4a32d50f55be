"""Whether a new turn may be taken, before anything of it is built (``Admission``): the
request's own limits, the model and the version that serves it, the tenant's turns and
streams, the model's context, and the caller's buckets."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from gateway.auth import Caller, Guard
from gateway.fleet import Fleet
from gateway.openai_api import ChatRequest
from gateway.problems import ContextTooLong, ModelNotFound, ModelUnavailable, OverLimit
from gateway.settings import GatewaySettings
from schemas import ChatMessage
from schemas.rollout import Rollout


class Admission:
    """``fleet``: the workers' models, limits and loads, and the rollouts; ``guard``:
    the callers' buckets; ``check_streams(tenant)`` refuses a stream over the tenant's
    cap (``Follow.check_streams``)."""

    def __init__(self, settings: GatewaySettings, fleet: Fleet, guard: Guard,
                 check_streams: Callable[[str], None]) -> None:
        self.settings = settings
        self.fleet = fleet
        self.guard = guard
        self._check_streams = check_streams

    @property
    def models(self) -> list[str]:
        """The models live workers serve; before any worker is up, the configured ones
        (requests for them wait in the log for a worker)."""
        return sorted(self.fleet.models | self.fleet.aliases) or self.settings.models

    def check_model(self, version: str) -> None:
        """A version live workers serve, or configured (``GATEWAY_MODELS``: its turns wait
        in the log for a worker); one served within the hour and not now is refused for
        now (503); any other does not exist (404)."""
        if version not in self.fleet.models and version not in self.settings.models:
            raise ModelUnavailable(version) if version in self.fleet.known \
                else ModelNotFound(version)

    def check_limits(self, request: ChatRequest) -> None:
        if len(request.messages) > self.settings.max_messages:
            raise OverLimit(f"At most {self.settings.max_messages} messages per request.",
                            "messages")
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is not None and max_tokens > self.settings.max_tokens_limit:
            raise OverLimit(f"max_tokens is at most {self.settings.max_tokens_limit}.",
                            "max_tokens")

    def route(self, model: str, conversation: uuid.UUID) -> tuple[str, Rollout | None]:
        """The version a new turn of ``conversation`` asked for ``model`` goes to (an
        alias's, as its rollout record picks: ``schemas.rollout``), refused if none
        serves it, and the alias record that decided it."""
        version, routed_by = self.fleet.route(model, conversation)
        self.check_model(version)
        return version, routed_by

    def admit(self, version: str, tenant: str, stream: bool) -> None:
        """Refuse a turn over the tenant's caps on turns for ``version`` or the model's
        backlog (``Fleet.admit``), or, as a ``stream``, on its open streams."""
        self.fleet.admit(version, tenant)
        if stream:
            self._check_streams(tenant)

    def check_context(self, model: str, history: list[ChatMessage],
                      new: tuple[ChatMessage, ...], max_tokens: int | None) -> None:
        """Refuse (400 ``context_length_exceeded``) a turn that cannot fit the model's
        context whatever its tokens: its text needs at least as many tokens as it has
        bytes over the most bytes one token of the model's stands for (its workers say
        both). The worker's exact count decides every other case."""
        limits = self.fleet.limits(model)
        if limits is None:
            return
        context, token_bytes = limits
        text = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in (*history, *new))
        at_least = -(-text // (2 * token_bytes))  # halved again, to be certain
        if at_least + (max_tokens or 1) > context:
            raise ContextTooLong(
                f"This model's maximum context length is {context:,} tokens; the session's "
                f"{len(history)} messages and this request's {len(new)} need at least "
                f"{at_least:,} tokens (of {text:,} bytes), with "
                f"{'max_tokens ' + format(max_tokens, ',') if max_tokens else 'one'} more.")

    async def charge(self, caller: Caller, tokens: int) -> None:
        """Take the turn's estimated tokens from the caller's buckets (429 if too few)."""
        await self.guard.charge(caller, requests=0, tokens=tokens)
