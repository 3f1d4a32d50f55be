"""``/v1/memories``: a user's memories, listed and forgotten, through the memory service
(``gateway.memory``). A user is the caller's tenant plus ``user`` (a query parameter)."""

from __future__ import annotations

from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError
from gateway.http import resources, tenant_of

MAX_USER_CHARS = 200


def _user(request: Request) -> str:
    user = request.query_params.get("user")
    if not user or len(user) > MAX_USER_CHARS or "\0" in user:
        raise APIError(400, "user is required: the end user whose memories these are "
                       f"(1 to {MAX_USER_CHARS} characters).",
                       code="missing_required_parameter", param="user")
    return user


async def _relay(request: Request, method: str, path: str) -> Response:
    client = resources(request).memory
    params = {"tenant": tenant_of(request), "user": _user(request)}
    response = await client._call(method, path, params=params)
    return JSONResponse(response.json(), status_code=response.status_code)


async def list_memories(request: Request) -> Response:
    """``GET /v1/memories?user=U``: the user's memories, the newest first."""
    return await _relay(request, "GET", "/v1/memories")


async def delete_memories(request: Request) -> Response:
    """``DELETE /v1/memories?user=U``: forget all of the user's memories."""
    return await _relay(request, "DELETE", "/v1/memories")


async def delete_memory(request: Request) -> Response:
    """``DELETE /v1/memories/{id}?user=U``: forget one."""
    memory_id = request.path_params["memory_id"]
    if len(memory_id) > 200:
        raise APIError(404, "No such memory.", code="memory_not_found")
    return await _relay(request, "DELETE", f"/v1/memories/{quote(memory_id, safe='')}")
