"""OpenAI chat-completions wire format: the request model and the response shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from gateway.edge import load_json
from gateway.errors import APIError
from schemas import ChatMessage, SamplingParams, Usage
from schemas.events import MAX_COUNT

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop"}


def finish_reason_json(reason: str) -> str:
    """OpenAI's ``finish_reason`` for a turn's: a cancelled turn (``abort``), or any other
    the API has no word for, stopped."""
    return FINISH_REASONS.get(reason, "stop")

def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("user holds no NUL")
    return value


# OpenAI's ``user``: the end user, within the caller's tenant.
EndUser = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_no_nul)]
MAX_MODEL_CHARS = 256
MAX_STOP = 4
MAX_STOP_CHARS = 1000


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


Role = Literal["system", "user", "assistant", "tool", "developer"]


class InMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        # Said here, where a union's own error would name its first member ('.str').
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i} is {kind!r}: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i} needs 'text', a string")
        elif not isinstance(value, str):
            raise ValueError("content is a string or a list of text parts")
        return value

    def to_event(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content
        )
        return ChatMessage(role=self.role, content=text)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    messages: list[InMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # vLLM's extensions, as its own server and benchmark clients send them.
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    # A signed 64-bit integer, as vLLM's own API takes it.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    # Not OpenAI's: keep generating even when every client has gone away (as the
    # Responses API's "background"); fetch or re-attach to the result by its id.
    background: bool = False
    # vLLM's extension: keep generating past end-of-sequence, up to max_tokens.
    ignore_eos: bool = False
    # OpenAI's: the end user, within the caller's tenant. A new session's data key is
    # recorded as this user's, so ``pipeline erase --user`` finds it.
    user: EndUser | None = None
    # Not OpenAI's: recall the user's memories into this turn, and remember it for them
    # (the service's long-term memory; needs ``user``).
    memory: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        stops = [value] if isinstance(value, str) else value or []
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        if any(not s for s in stops):
            raise ValueError("a stop sequence cannot be empty")  # as vLLM refuses it
        return value

    def sampling(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            stop=stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


M = TypeVar("M", bound=BaseModel)


def _absent(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in neutral


# Fields of OpenAI's or vLLM's API that this service does not honour, each with the
# values that ask for nothing (what a client sends by default). Any other value is a
# 400, never ignored: the reply would not be what the client asked for. A field named
# by neither API is ignored, as vLLM's server ignores it.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _absent(1),
    "best_of": _absent(1),
    "logprobs": _absent(False),
    "top_logprobs": _absent(0),
    "prompt_logprobs": _absent(0),
    "tools": _absent([]),
    "functions": _absent([]),
    "tool_choice": _absent("none", "auto"),
    "function_call": _absent("none", "auto"),
    "response_format": _absent({"type": "text"}),
    "logit_bias": _absent({}),
    "modalities": _absent(["text"]),
    "audio": _absent(),
    "prediction": _absent(),
    "web_search_options": _absent(),
    "use_beam_search": _absent(False),
    "echo": _absent(False),
    "add_generation_prompt": _absent(True),
    "continue_final_message": _absent(False),
    "structured_outputs": _absent(),
    "guided_json": _absent(),
    "guided_regex": _absent(),
    "guided_choice": _absent(),
    "guided_grammar": _absent(),
    "bad_words": _absent([]),
    "allowed_token_ids": _absent(),
    "min_tokens": _absent(0),
}


def refuse_unsupported(data: dict[str, Any]) -> None:
    """A 400 for the first field of ``UNSUPPORTED`` that asks for something."""
    for name, asks_nothing in UNSUPPORTED.items():
        if name in data and not asks_nothing(data[name]):
            raise APIError(400, f"'{name}' is not supported: send it unset or "
                           "at its default.", code="unsupported_value", param=name)


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``data`` as ``model``, or a 400 naming the first field that is wrong."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc


def invalid(exc: ValidationError) -> APIError:
    """A 400 naming the first field ``exc`` says is wrong."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return APIError(400, f"Invalid value for '{param}': {err['msg']}.",
                    code="invalid_value" if err["type"] != "missing" else "missing_required",
                    param=param)


def parse_chat_request(body: bytes | dict[str, Any]) -> ChatRequest:
    """Parse and validate a request body, or raise a 400 that says what is wrong."""
    data = body if isinstance(body, dict) else load_json(body)
    refuse_unsupported(data)
    request = validate(ChatRequest, data)
    try:  # what the prompt event will carry: a request it cannot carry is the client's
        request.sampling()
    except ValidationError as exc:
        raise invalid(exc) from exc
    return request


def usage_json(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def chunk(
    completion_id: str, created: int, model: str, delta: dict[str, Any],
    finish_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish_reason}],
    }


def usage_chunk(completion_id: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


def completion(
    completion_id: str, created: int, model: str, text: str, finish_reason: str, usage: Usage
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason_json(finish_reason),
        }],
        "usage": usage_json(usage),
    }
