"""The services' log lines: text by default, or one JSON object per line
(``PIPELINE_LOG_FORMAT=json``) for a log shipper. A line about a turn carries its
``request_id``, ``conversation_id`` and ``tenant``: from the turn bound to the current
task (the gateway binds each request's), or given with the call
(``log.info(..., extra=turn_fields(prompt))``, as a worker does for the turn at hand).
"""

from __future__ import annotations

import json
import logging
import os
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

TURN_FIELDS = ("request_id", "conversation_id", "tenant")
# A line's message is cut here: a record's bytes quoted in a warning, or a client's
# value in an error, must not make one line as long as the input (a 1 MB key would).
MESSAGE_CHARS = 4000
_turn: ContextVar[dict[str, str] | None] = ContextVar("pipeline_turn", default=None)


class Turn(Protocol):
    request_id: str
    conversation_id: Any
    tenant: str


def turn_fields(turn: Turn) -> dict[str, str]:
    """A turn's fields, for ``extra=``."""
    return {"request_id": turn.request_id, "conversation_id": str(turn.conversation_id),
            "tenant": turn.tenant}


def bind_turn(**fields: object) -> None:
    """Lines logged from now on in this task (and the tasks it starts) carry ``fields``
    (any of request_id, conversation_id, tenant) besides the ones already bound."""
    bound = dict(_turn.get() or {})
    bound.update({k: str(v) for k, v in fields.items() if k in TURN_FIELDS and v is not None})
    _turn.set(bound)


class TurnFilter(logging.Filter):
    """Puts the bound turn's fields on each record that was not given its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_turn.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def bounded(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message``, cut to ``limit`` characters with how many were left out."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters)"


def shown(value: bytes | None, limit: int = 64) -> str:
    """A record's key or value as a log line quotes it: its first ``limit`` bytes, and
    its length when there is more."""
    if value is None or len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} bytes)"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": bounded(record.getMessage()),
        }
        for key in TURN_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = bounded(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [f"{k}={getattr(record, k)}" for k in TURN_FIELDS
                  if getattr(record, k, None) is not None]
        return f"{text} [{' '.join(fields)}]" if fields else text


LogFormat = Literal["text", "json"]


def log_format() -> LogFormat:
    return "json" if os.environ.get("PIPELINE_LOG_FORMAT", "").lower() == "json" else "text"


def setup_logging(level: str = "INFO", form: LogFormat = "text") -> None:
    """One handler on the root logger, for every library's lines. With JSON, vLLM is
    asked not to install handlers of its own (its lines then come here too)."""
    if form == "json":
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else TextFormatter())
    handler.addFilter(TurnFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
