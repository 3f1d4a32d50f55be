"""What every request must satisfy before any handler sees it.

* **JSON bodies** are parsed by one function, ``load_json``: malformed JSON, numbers
  Python will not convert, nesting deeper than ``MAX_DEPTH`` and text that cannot be
  stored (NUL, unpaired surrogates) anywhere in the body, keys included, are 400s.
  So every text field a request carries (content, stop, titles, names, metadata)
  follows one rule, whether or not the pipeline keeps it.
* **Headers that reach the log** are bounded here: ``Idempotency-Key`` is 1-255
  printable ASCII characters.
* ``AllowedHosts``: requests whose ``Host`` is not on the allow-list are refused, so a
  web page cannot reach a gateway on a private address through DNS rebinding.
* ``JsonOnly``: a ``/v1`` request that sends a body must send it as
  ``application/json`` (415 otherwise), so a cross-site HTML form cannot post to it
  (browsers send JSON cross-site only after a CORS preflight, which is never granted).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

MAX_DEPTH = 32
IDEMPOTENCY_KEY_CHARS = 255
_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,253}[\x21-\x7e])?")
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def load_json(body: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object, or a 400 that says what is wrong."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer past Python's digit limit
        raise APIError(400, f"The request body is not valid JSON: {exc}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    check_text(data)
    return data


def _too_deep() -> APIError:
    return APIError(400, f"The request body is nested more than {MAX_DEPTH} levels deep.",
                    code="invalid_json")


def check_text(value: Any) -> None:
    """Refuse (400) a JSON value nested past ``MAX_DEPTH`` or holding a string, key or
    value, that cannot be stored: NUL, or an unpaired surrogate (not Unicode text)."""
    todo: list[tuple[Any, str, int]] = [(value, "", 0)]
    while todo:
        item, path, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(item, str):
            _check_string(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_string(key, path or "(key)")
                todo.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            todo.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_string(text: str, path: str) -> None:
    found = _UNSTORABLE.search(text)
    if found is None:
        return
    what = "NUL (\\u0000)" if found.group() == "\x00" else "an unpaired surrogate"
    raise APIError(400, f"Invalid value for '{path}': text must not contain {what}.",
                   code="invalid_value", param=path or None)


def idempotency_key(raw: str | None) -> str | None:
    """The ``Idempotency-Key`` header's value, or a 400 if it is not 1-255 printable
    ASCII characters (it becomes part of a stored event and of a completion id)."""
    if raw is None:
        return None
    if not _IDEMPOTENCY_KEY.fullmatch(raw):
        raise APIError(400, f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_CHARS} printable "
                       "ASCII characters, not starting or ending with a space.",
                       code="invalid_idempotency_key", param="Idempotency-Key")
    return raw


def host_name(header: str) -> str:
    """The host of a ``Host`` header value: no port, brackets around IPv6 removed."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether ``host`` matches an entry: a name, ``*.domain`` (any subdomain), or ``*``."""
    for pattern in allowed:
        pattern = pattern.strip().lower().strip("[]")
        if pattern == "*" or pattern == host:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(entries: Iterable[str]) -> list[Network]:
    """``GATEWAY_TRUSTED_PROXIES``' entries: addresses or networks (ValueError if not)."""
    return [ipaddress.ip_network(entry.strip(), strict=False) for entry in entries
            if entry.strip()]


def _address(token: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address in one hop of Forwarded's ``for=`` or X-Forwarded-For ("1.2.3.4",
    "1.2.3.4:80", "[2001:db8::1]:80", "2001:db8::1"); None if it holds none."""
    token = token.strip().strip('"')
    if token.startswith("["):
        token = token[1:token.find("]")] if "]" in token else ""
    elif token.count(":") == 1:
        token = token.split(":", 1)[0]
    try:
        return ipaddress.ip_address(token)
    except ValueError:
        return None


def forwarded_client(peer: str, headers: Sequence[tuple[bytes, bytes]],
                     trusted: Sequence[Network]) -> str:
    """The client a request comes from: ``peer``, unless ``peer`` is a trusted proxy;
    then the nearest hop of its ``Forwarded`` (or else ``X-Forwarded-For``) chain that
    is not a trusted proxy itself. A chain that names no address leaves ``peer``."""
    def is_trusted(address: object) -> bool:
        return address is not None and any(address in net for net in trusted)

    if not trusted or not is_trusted(_address(peer)):
        return peer
    forwarded = [v.decode("latin-1") for k, v in headers if k == b"forwarded"]
    if forwarded:
        hops = [param.split("=", 1)[1] for element in ",".join(forwarded).split(",")
                for param in element.split(";")
                if param.strip().lower().startswith("for=")]
    else:
        hops = [hop for k, v in headers if k == b"x-forwarded-for"
                for hop in v.decode("latin-1").split(",")]
    for hop in reversed(hops):
        address = _address(hop)
        if address is None:
            return peer  # an unknown or obfuscated hop: nothing further is believed
        if not is_trusted(address):
            return str(address)
    return peer


class ClientAddress:
    """ASGI middleware: ``scope["client"]`` becomes the client a trusted proxy names
    (``forwarded_client``)."""

    START_ONLY = True

    def __init__(self, app: ASGIApp, trusted: Sequence[Network]) -> None:
        self.app = app
        self.trusted = list(trusted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if self.trusted and scope["type"] == "http" and client:
            named = forwarded_client(client[0], scope["headers"], self.trusted)
            if named != client[0]:
                scope = {**scope, "client": (named, 0)}
        await self.app(scope, receive, send)


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)


class AllowedHosts:
    """ASGI middleware: only requests whose ``Host`` is allowed reach the app."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not host_allowed(host_name(raw), self.allowed):
            await _refuse(APIError(
                400, f"Host '{raw[:100]}' is not served here; add it to GATEWAY_ALLOWED_HOSTS.",
                code="invalid_host"), scope, receive, send)
            return
        await self.app(scope, receive, send)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


class JsonOnly:
    """ASGI middleware: a ``/v1`` request that may change something (not GET, HEAD or
    OPTIONS) and sends a body, or declares a content type, must declare JSON (415)."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not scope["path"].startswith("/v1/")
                or scope["method"] in ("GET", "HEAD", "OPTIONS")):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type")
        length = headers.get(b"content-length", b"0").strip()
        has_body = b"transfer-encoding" in headers or length not in (b"", b"0")
        if (content_type is not None or has_body) and not _is_json(
                (content_type or b"").decode("latin-1")):
            await _refuse(APIError(
                415, "Send the request body as JSON, with 'Content-Type: application/json'.",
                code="unsupported_media_type"), scope, receive, send)
            return
        await self.app(scope, receive, send)
