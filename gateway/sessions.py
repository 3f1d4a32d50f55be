"""``/v1/sessions``: create, list, read, continue and delete conversations.

Creating and deleting a session are events on ``chat.prompts`` like any other fact;
the projection and replay honour them. Reads of one session fold the log beyond
the projection in, so they see the caller's own writes at once.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.completions import parse_session_id, respond
from gateway.edge import load_json
from gateway.errors import APIError
from gateway.http import read_body, resources, tenant_of
from gateway.openai_api import EndUser, InMessage, Role, parse_chat_request, validate
from gateway.store import session_json


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(default=None, max_length=200)
    # Memory on for every turn of the session (that does not say otherwise), for this
    # end user (``docs/memory.md``).
    memory: bool = False
    user: EndUser | None = None

    @model_validator(mode="after")
    def _memory_has_a_user(self) -> NewSession:
        if self.memory and self.user is None:
            raise ValueError("memory needs a user: the end user whose memories these are")
        return self


class NewMessage(InMessage):
    """A message appended to a session: ``content``, and ``role`` (default ``user``)."""

    role: Role = "user"


async def create(request: Request) -> Response:
    res = resources(request)
    body = await read_body(request, res.settings.max_body_bytes)
    new = validate(NewSession, load_json(body) if body.strip() else {})
    event = await res.sessions.create(tenant_of(request), new.title, new.user,
                                          new.memory)
    created = session_json(event.conversation_id, new.title, event.occurred_at,
                           event.occurred_at)
    if new.memory:
        created["memory"] = {"user": new.user}
    return JSONResponse(created, status_code=201)


async def list_sessions(request: Request) -> Response:
    res = resources(request)
    raw_limit = request.query_params.get("limit", "20")
    if not re.fullmatch(r"[0-9]{1,3}", raw_limit) or not 1 <= int(raw_limit) <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100.", code="invalid_value",
                       param="limit")
    raw_after = request.query_params.get("after")
    try:
        after = uuid.UUID(raw_after) if raw_after else None
    except ValueError:
        raise APIError(400, "after must be a session id.", code="invalid_value",
                       param="after") from None
    data, more = await res.store.list_sessions(tenant_of(request), int(raw_limit), after)
    return JSONResponse({"object": "list", "data": data, "has_more": more})


async def get(request: Request) -> Response:
    res = resources(request)
    session = parse_session_id(request.path_params["session_id"])
    view = await res.sessions.visible_view(session, tenant_of(request))
    return JSONResponse(session_json(session, view.title, view.created_at, view.updated_at))


async def delete(request: Request) -> Response:
    res = resources(request)
    session = parse_session_id(request.path_params["session_id"])
    await res.sessions.delete(session, tenant_of(request))
    return JSONResponse({"id": str(session), "object": "session.deleted", "deleted": True})


async def messages(request: Request) -> Response:
    res = resources(request)
    session = parse_session_id(request.path_params["session_id"])
    view = await res.sessions.visible_view(session, tenant_of(request))
    data: list[dict[str, Any]] = [
        {"seq": seq, "role": m.role, "content": m.content, "request_id": m.request_id,
         "created_at": m.created_at.isoformat()}
        for seq, m in sorted(view.messages.items())
    ]
    return JSONResponse({"object": "list", "session_id": str(session), "data": data})


async def append(request: Request) -> Response:
    """Append a message and answer with the reply, as a chat completion would. The body
    takes ``content`` (and optionally ``role``) or ``messages``, and the chat
    completion fields; ``model`` defaults to the session's last one."""
    res = resources(request)
    session = parse_session_id(request.path_params["session_id"])
    data = load_json(await read_body(request, res.settings.max_body_bytes))
    if "messages" in data:
        if "content" in data or "role" in data:
            raise APIError(400, "Give either 'content' (and 'role') or 'messages', not both.",
                           code="invalid_value", param="messages")
    else:
        message = validate(NewMessage, {k: data.pop(k) for k in ("role", "content")
                                        if k in data})
        data["messages"] = [message.model_dump()]
    if "model" not in data:
        view = await res.sessions.visible_view(session, tenant_of(request))
        used = sorted((t.submitted_at, t.model) for t in view.turns.values()
                      if t.submitted_at and t.model)
        data["model"] = used[-1][1] if used else res.admission.models[0]
    return await respond(request, parse_chat_request(data), session)
