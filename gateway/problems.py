"""What the chat service refuses, said without HTTP. ``gateway.errors`` maps each to its
status and OpenAI-shaped body, in one place, as Starlette maps ``HTTPException``."""

from __future__ import annotations


class Problem(Exception):
    """A request the service cannot serve, and why."""


class SessionNotFound(Problem):
    def __init__(self, session: object) -> None:
        super().__init__(f"No session found with id '{str(session)[:100]}'.")


class CompletionNotFound(Problem):
    def __init__(self, completion: str) -> None:
        super().__init__(f"No chat completion found with id '{completion[:100]}'.")


class ModelNotFound(Problem):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model[:256]}' does not exist.")


class ModelUnavailable(Problem):
    """A model served within the hour that no live worker serves now (and turns for it
    are not configured to wait in the log): refused for now, not as unknown."""

    def __init__(self, model: str) -> None:
        super().__init__(f"No worker serves the model '{model[:256]}' right now; retry "
                         "shortly.")


class OverLimit(Problem):
    """A request past a configured limit (``param`` names the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLarge(Problem):
    """The turn's prompt, as a record, is larger than the log takes: refused alone, at
    once, before it is queued with any other."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"The request's prompt ({size:,} bytes as a log record) is larger "
                         f"than the log takes ({limit:,} bytes).")


class ContextTooLong(Problem):
    """The session and the request cannot fit the model's context, whatever its tokens."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class InvalidLastEventId(Problem):
    def __init__(self, raw: str | None = None) -> None:
        super().__init__(f"'{raw[:100]}' is not an event id of this stream." if raw is not None
                         else "Last-Event-ID does not name an event of this stream.")


class TurnInProgress(Problem):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"The session has a turn in progress ({request_id}); wait for it to "
                         "finish, then send the next message.")
        self.request_id = request_id


class LogUnavailable(Problem):
    """Kafka did not answer in time. For a new turn, ``request_id`` names it: it was not
    accepted and will never run (a retry with the same Idempotency-Key is safe)."""

    def __init__(self, request_id: str | None = None) -> None:
        super().__init__("The log is unavailable; the request was not accepted.")
        self.request_id = request_id


class NotAcceptedInTime(Problem):
    """A new turn whose steps before its commit (its session, key, memories, following)
    took longer than the acceptance's bound: never written, never run."""

    def __init__(self, request_id: str, bound_s: float) -> None:
        super().__init__(f"The request was not accepted within {bound_s:g} s: a service it "
                         "needs answered too slowly. It was not written and will never run; "
                         "retry shortly (with the same Idempotency-Key, a retry is safe).")
        self.request_id = request_id


class StoreUnavailable(Problem):
    def __init__(self) -> None:
        super().__init__("The conversation store is unavailable; retry shortly.")


class AnswerTimeout(Problem):
    """A read whose calls to the log and the store took longer, all together, than its
    answer may (``GATEWAY_ANSWER_TIMEOUT_S``)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"The service could not answer within {timeout_s:g} s; retry "
                         "shortly.")


class StoreLagging(Problem):
    def __init__(self) -> None:
        super().__init__("The conversation store is too far behind the log; retry shortly.")


class BacklogFull(Problem):
    def __init__(self, backlog: int, bound: int, retry_after_s: int) -> None:
        super().__init__(f"The workers are {backlog} prompts behind (bound {bound}); retry "
                         f"after {retry_after_s} s.")
        self.retry_after_s = retry_after_s


class TenantLimit(Problem):
    """One tenant's share is used up (``what``: waiting prompts, running turns or open
    streams), whatever the others do."""

    def __init__(self, what: str, count: int, cap: int, setting: str) -> None:
        super().__init__(f"This tenant has {count:,} {what} (the cap is {cap:,}, "
                         f"{setting}); retry once some have ended.")
        self.code = "tenant_" + what.replace(" ", "_") + "_cap"


class ErasuresCapped(Problem):
    """The tenant deleted as many sessions in the erasure window as it may."""

    def __init__(self, count: int, cap: int, retry_after_s: float) -> None:
        super().__init__(f"This tenant deleted {count:,} sessions within the erasure window "
                         f"(the cap is {cap:,}, GATEWAY_MAX_ERASURES_PER_TENANT); retry in "
                         f"{retry_after_s:.0f} s.")
        self.retry_after_s = max(int(retry_after_s + 0.999), 1)


class RecallsBusy(Problem):
    """The memory service has as many of this tenant's recalls waiting as it takes."""


class GenerationTimeout(Problem):
    def __init__(self) -> None:
        super().__init__("The generation did not finish in time; it was cancelled.")


class StreamLagging(Problem):
    def __init__(self, message: str) -> None:
        super().__init__(message)


class GenerationFailure(Problem):
    """A turn that ended in ``GenerationFailed``; ``by_request``: the request was at fault
    (too long for the model, bad sampling parameters), not the service."""

    def __init__(self, code: str, message: str, by_request: bool) -> None:
        super().__init__(message)
        self.code = code
        self.by_request = by_request


class MemoryUnavailable(Problem):
    """The memory service did not answer (or is not configured): a turn that asked for
    memory is refused rather than run without it."""

    def __init__(self, why: str) -> None:
        super().__init__(f"Memory is unavailable: {why}")
        self.configured = "not enabled" not in why
