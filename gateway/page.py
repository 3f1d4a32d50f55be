"""The chat page at ``/``: plain HTML, CSS and JavaScript from ``gateway/web``, no build
step. It calls the same ``/v1`` API as any client, with the API key the user typed
(kept in the browser), so it needs no route or permission of its own."""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

ASSETS = {"chat.js": "text/javascript", "chat.css": "text/css"}
# Only this page's own files run or load; nothing inline, no other origin, no framing.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _read(name: str) -> bytes:
    return resources.files("gateway").joinpath("web", name).read_bytes()


async def index(request: Request) -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8",
                    headers=HEADERS)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        raise HTTPException(404)
    return Response(_read(name), media_type=f"{ASSETS[name]}; charset=utf-8", headers=HEADERS)
