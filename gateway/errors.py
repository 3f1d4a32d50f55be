"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.problems import (
    AnswerTimeout,
    BacklogFull,
    CompletionNotFound,
    ContextTooLong,
    ErasuresCapped,
    GenerationFailure,
    GenerationTimeout,
    InvalidLastEventId,
    LogUnavailable,
    MemoryUnavailable,
    ModelNotFound,
    ModelUnavailable,
    NotAcceptedInTime,
    OverLimit,
    Problem,
    PromptTooLarge,
    RecallsBusy,
    SessionNotFound,
    StoreLagging,
    StoreUnavailable,
    StreamLagging,
    TenantLimit,
    TurnInProgress,
)

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


class APIError(Exception):
    """An HTTP error in OpenAI's shape, raised where HTTP is handled (parsing, headers,
    auth); the service's own refusals are ``gateway.problems`` (see ``api_error``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(problem: Problem) -> APIError:
    """The one place a refusal of the service becomes an HTTP status and body."""
    message = str(problem)
    match problem:
        case SessionNotFound():
            return APIError(404, message, code="session_not_found", param="session_id")
        case CompletionNotFound():
            return APIError(404, message, code="completion_not_found")
        case ModelNotFound():
            return APIError(404, message, code="model_not_found", param="model")
        case ModelUnavailable():
            return APIError(503, message, code="model_unavailable", param="model",
                            headers={"Retry-After": "5"})
        case OverLimit():
            code = "too_many_messages" if problem.param == "messages" else "invalid_value"
            return APIError(400, message, code=code, param=problem.param)
        case PromptTooLarge():
            return APIError(413, message, code="prompt_too_large", param="messages")
        case ContextTooLong():
            return APIError(400, message, code="context_length_exceeded", param="messages")
        case InvalidLastEventId():
            return APIError(400, message, code="invalid_last_event_id", param="Last-Event-ID")
        case TurnInProgress():
            return APIError(409, message, code="turn_in_progress")
        case LogUnavailable():
            ids = {"X-Request-Id": problem.request_id} if problem.request_id else {}
            return APIError(503, message, code="log_unavailable",
                            headers={"Retry-After": "2", **ids})
        case NotAcceptedInTime():
            return APIError(503, message, code="accept_timeout",
                            headers={"Retry-After": "2", "X-Request-Id": problem.request_id})
        case MemoryUnavailable():
            if not problem.configured:
                return APIError(400, message, code="memory_not_enabled", param="memory")
            return APIError(503, message, code="memory_unavailable",
                            headers={"Retry-After": "2"})
        case StoreUnavailable():
            return APIError(503, message, code="store_unavailable",
                            headers={"Retry-After": "2"})
        case AnswerTimeout():
            return APIError(503, message, code="answer_timeout",
                            headers={"Retry-After": "2"})
        case StoreLagging():
            return APIError(503, message, code="projection_lagging",
                            headers={"Retry-After": "2"})
        case TenantLimit():
            return APIError(429, message, code=problem.code, headers={"Retry-After": "2"})
        case ErasuresCapped():
            return APIError(429, message, code="tenant_erasures_cap",
                            headers={"Retry-After": str(problem.retry_after_s)})
        case RecallsBusy():
            return APIError(429, message, code="tenant_recalls_cap",
                            headers={"Retry-After": "1"})
        case BacklogFull():
            return APIError(429, message, code="backlog_full",
                            headers={"Retry-After": str(problem.retry_after_s)})
        case GenerationTimeout():
            return APIError(504, message, code="generation_timeout")
        case StreamLagging():
            return APIError(503, message, code="stream_lagging")
        case GenerationFailure():
            if problem.by_request:
                return APIError(400, message, code=problem.code)
            return APIError(502, f"The generation failed: {message}", code=problem.code)
    return APIError(500, "The server had an error while processing your request.",
                    code="internal_error")


async def problem_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    return api_error(exc).response()


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "error")
    return APIError(status, str(detail), code=None).response()


# nginx's status for a request its client closed before the answer: no one receives it,
# but the request metrics count it apart from the server's errors.
CLIENT_CLOSED = 499


async def client_left_handler(request: Request, exc: Exception) -> Response:
    """The client closed its connection before its request was read whole: said once,
    at debug level, without a traceback (an ordinary event, not an error)."""
    log.debug("the client left %s %s before its request was read", request.method,
              request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return APIError(500, "The server had an error while processing your request.",
                    code="internal_error").response()
