"""The gateway's OpenAPI document, served at ``/openapi.json``. Request bodies come from
the same pydantic models that validate them, so the document cannot drift from them."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel

from gateway.openai_api import ChatRequest

REF = "#/components/schemas/{model}"


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": REF.format(model="Error")}}}}


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"type": "object"}}}}


def _op(op_id: str, summary: str, ok: dict[str, Any], *errors: int,
        body: dict[str, Any] | None = None, params: list[dict[str, Any]] | None = None,
        status: str = "200") -> dict[str, Any]:
    reasons = {400: "Invalid request", 404: "Not found", 409: "Conflict",
               413: "Body too large", 415: "The body is not sent as application/json",
               429: "Over a limit (a rate, the backlog, a tenant's cap); see Retry-After",
               503: "Kafka or the store is unavailable; see Retry-After"}
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": {
        status: ok, **{str(code): _error(reasons[code]) for code in errors}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        op["responses"]["415"] = _error(reasons[415])
    if params:
        op["parameters"] = params
    return op


def _path(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description,
            "schema": {"type": "string"}}


@cache
def openapi_spec() -> dict[str, Any]:
    components: dict[str, Any] = {"Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}
    chat = _schema(ChatRequest, components)
    stream = {"description": "A chat completion, or SSE chunks when stream is true: "
                             "data lines only, each chunk standing for a log event with "
                             "its position as event_id (send it back as Last-Event-ID to "
                             "the X-Resume-Url header's address to continue)",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": {"type": "string"}}}}
    completion = _path("completion_id", "A chat completion id (chatcmpl-...)")
    session = _path("session_id", "A session id (UUID)")
    session_body = {"type": "object", "additionalProperties": False,
                    "properties": {"title": {"type": ["string", "null"], "maxLength": 200},
                                   "memory": {"type": "boolean"},
                                   "user": {"type": ["string", "null"]}}}
    append_body = {"type": "object", "required": ["content"], "properties": {
        "content": {"type": "string"}, "role": {"type": "string", "enum": ["user", "system"]},
        "model": {"type": "string"}, "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1}}}
    user = {"name": "user", "in": "query", "required": True, "schema": {"type": "string"},
            "description": "The end user (with the caller's tenant) whose memories these are"}
    created = _json("The session")
    created["links"] = {  # what a client (or a fuzzer) can do with a new session
        name: {"operationId": op, "parameters": {"session_id": "$response.body#/id"}}
        for name, op in (("GetSession", "getSession"), ("DeleteSession", "deleteSession"),
                         ("GetMessages", "getMessages"), ("AppendMessage", "appendMessage"))}
    paths = {
        "/v1/chat/completions": {"post": _op(
            "createChatCompletion", "Create a chat completion (OpenAI-compatible)", stream,
            400, 404, 409, 413, 429, 503, body=chat, params=[
                {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}},
                {"name": "X-Session-Id", "in": "header", "schema": {"type": "string"}}])},
        "/v1/chat/completions/{completion_id}": {"get": _op(
            "getChatCompletion", "A turn's status and reply", _json("The completion"), 404,
            503, params=[completion])},
        "/v1/chat/completions/{completion_id}/stream": {"get": _op(
            "streamChatCompletion", "Re-attach to a turn's stream, after Last-Event-ID if given "
            "(the same chunks, with id lines for EventSource)", stream, 400, 404, 503, params=[
                completion,
                {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}},
                {"name": "starting_after", "in": "query", "schema": {"type": "string"}}])},
        "/v1/chat/completions/{completion_id}/cancel": {"post": _op(
            "cancelChatCompletion", "Stop a running turn", _json("The cancellation"), 404, 503,
            params=[completion])},
        "/v1/sessions": {
            "post": _op("createSession", "Create a session", created, 400, 413, 503,
                        body=session_body, status="201"),
            "get": _op("listSessions", "The caller's sessions, newest first",
                       _json("A page of sessions"), 400, 503, params=[
                           {"name": "limit", "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                           {"name": "after", "in": "query", "schema": {"type": "string"}}])},
        "/v1/sessions/{session_id}": {
            "get": _op("getSession", "A session", _json("The session"), 404, 503,
                       params=[session]),
            "delete": _op("deleteSession", "Delete a session", _json("Deleted"), 404, 429,
                          503, params=[session])},
        "/v1/sessions/{session_id}/messages": {
            "get": _op("getMessages", "A session's messages", _json("The messages"), 404, 503,
                       params=[session]),
            "post": _op("appendMessage", "Append a message and get the reply", stream, 400, 404,
                        409, 413, 429, 503, body=append_body, params=[session])},
        "/v1/models": {"get": _op("listModels", "The models the workers serve",
                                  _json("Models"))},
        # Its numbers are given without their bounds, so that a fuzzer tries past them
        # (the gateway answers 400 naming the bound).
        "/v1/usage": {"get": _op(
            "getUsage", "The caller's tenant's usage, in buckets of time",
            _json("A page of buckets"), 400, 503, params=[
                {"name": "start_time", "in": "query", "required": True,
                 "schema": {"type": "integer"}},
                {"name": "end_time", "in": "query", "schema": {"type": "integer"}},
                {"name": "bucket_width", "in": "query",
                 "schema": {"type": "string", "enum": ["1m", "1h", "1d"]}},
                {"name": "group_by", "in": "query", "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                {"name": "page", "in": "query", "schema": {"type": "string"}}])},
        "/v1/memories": {
            "get": _op("listMemories", "A user's memories, newest first",
                       _json("The memories"), 400, 503, params=[user]),
            "delete": _op("deleteMemories", "Forget all of a user's memories",
                          _json("How many were forgotten"), 400, 503, params=[user])},
        "/v1/memories/{memory_id}": {"delete": _op(
            "deleteMemory", "Forget one of a user's memories", _json("Forgotten"), 400, 404,
            503, params=[_path("memory_id", "A memory's id (its turn's chatcmpl-...)"), user])},
    }
    return {"openapi": "3.1.0",
            "info": {"title": "chat-pipeline gateway", "version": "0.1.0"},
            "paths": paths, "components": {"schemas": components}}
