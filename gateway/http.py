"""What every handler shares: the app's resources, the caller's tenant, body limits."""

from __future__ import annotations

import re
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from starlette.requests import Request

from gateway.accept import Accept
from gateway.admission import Admission
from gateway.auth import OPEN, Caller, Guard
from gateway.dependencies import Health
from gateway.errors import APIError
from gateway.eventstream import Streams
from gateway.follow import Follow
from gateway.memory import MemoryClient
from gateway.session_log import Sessions
from gateway.settings import GatewaySettings
from gateway.store import ConversationStore


@dataclass
class Resources:
    accept: Accept  # a new turn (admit, build, commit)
    follow: Follow  # a turn followed (attach, follow, collect, detach)
    sessions: Sessions
    admission: Admission  # the models served, and what a turn may ask
    store: ConversationStore
    memory: MemoryClient
    guard: Guard
    registry: CollectorRegistry
    settings: GatewaySettings
    health: Health
    streams: Streams
    ready: bool = False  # /readyz has once found every configured model served


def resources(request: Request) -> Resources:
    res: Resources = request.app.state.resources
    return res


def caller_of(request: Request) -> Caller:
    """Who is calling (set by ``gateway.auth.Authenticate`` on every ``/v1`` request)."""
    caller: Caller = getattr(request.state, "caller", OPEN)
    return caller


def tenant_of(request: Request) -> str:
    """The tenant the caller acts for: everything it reads or changes is scoped to it."""
    return caller_of(request).tenant


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes with a 413."""
    declared = request.headers.get("content-length", "")
    if re.fullmatch(r"[0-9]{1,19}", declared) and int(declared) > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.",
                       code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"The request body is larger than {limit} bytes.",
                           code="request_too_large")
    return bytes(body)
