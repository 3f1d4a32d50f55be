"""The gateway's connections, below the ASGI app: what a client may hold open, and for
how long, before any route sees its request.

uvicorn reads a request's head and body for the app, and holds a connection for as long
as its client is slow to send them: 1,500 connections that never finished their headers
and 200 that sent a body at one byte a second were all held for half a minute and more.
``protocol(limits)`` gives uvicorn an HTTP protocol that bounds them:

* a request's head (its line and headers) must come within ``header_timeout_s`` of the
  connection opening or of its first byte, and its body within ``body_timeout_s`` of
  its head: else **408** with a JSON body, and the connection closes;
* a request that is not HTTP/1.1 uvicorn can parse (a control character in a header,
  a broken request line) is answered **400** with a JSON body, as the app's errors are,
  where uvicorn would answer in plain text and log a line for each;
* one client address holds at most ``per_address`` connections at once: the next is
  answered **429** and closed. A trusted proxy's address (``GATEWAY_TRUSTED_PROXIES``)
  is not capped: its clients are many, and the proxy bounds them
  (``docs/deploying.md``).

Each refusal is counted (``gateway_connections_refused{reason}``) and logged once per
address per minute, not per connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import APIError

log = logging.getLogger(__name__)
# How often one address's refusals are logged.
LOG_EVERY_S = 60.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    per_address: int = 256
    trusted: tuple[Network, ...] = ()
    # Called with the reason of each refusal ("header_timeout", "body_timeout",
    # "per_address", "malformed"): the gateway's metric.
    refused: Callable[[str], None] = lambda _: None
    open: dict[str, int] = field(default_factory=dict)  # connections by client address
    _logged: dict[tuple[str, str], float] = field(default_factory=dict)

    def capped(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return True
        return not any(ip in net for net in self.trusted)

    def note(self, reason: str, address: str, message: str) -> None:
        self.refused(reason)
        now = time.monotonic()
        if now - self._logged.get((reason, address), -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[(reason, address)] = now
            log.warning("%s (%s); said once a minute per address", message, address)
            if len(self._logged) > 10_000:  # forget the oldest half
                for key in sorted(self._logged, key=self._logged.__getitem__)[:5_000]:
                    del self._logged[key]


def _refusal(status: int, reason: str, code: str, message: str) -> bytes:
    """A whole HTTP response, the error in the gateway's one shape (``APIError``)."""
    body = json.dumps(APIError(status, message, code=code).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


HEADER_TIMEOUT = _refusal(408, "Request Timeout", "request_timeout",
                          "The request's headers did not all come in time.")
BODY_TIMEOUT = _refusal(408, "Request Timeout", "request_timeout",
                        "The request's body did not all come in time.")
MALFORMED = _refusal(400, "Bad Request", "invalid_http",
                     "The request is not valid HTTP/1.1: its request line or a header "
                     "could not be parsed (a header value must not hold control "
                     "characters).")
# uvicorn's own line for each request it cannot parse: said by ``note`` instead, once a
# minute per address.
UNPARSED = "Invalid HTTP request received."
TOO_MANY = _refusal(429, "Too Many Requests", "too_many_connections",
                    "This address has too many connections open (GATEWAY_MAX_CONNECTIONS_"
                    "PER_ADDRESS); use fewer, or keep-alive.")


def protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, bounded by ``limits`` (see the module)."""

    class Bounded(HttpToolsProtocol):
        _address: str | None = None
        _timer: asyncio.TimerHandle | None = None
        _waiting_for: str = ""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if UNPARSED_FILTER not in self.logger.filters:  # (uvicorn's logging set anew)
                self.logger.addFilter(UNPARSED_FILTER)
            address = self.client[0] if self.client else ""
            if limits.capped(address):
                if limits.open.get(address, 0) >= limits.per_address:
                    limits.note("per_address", address,
                                f"refused a connection past {limits.per_address} open")
                    self._refuse(TOO_MANY)
                    return
                self._address = address
                limits.open[address] = limits.open.get(address, 0) + 1
            self._arm("header", limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._address is not None:
                left = limits.open.get(self._address, 1) - 1
                if left > 0:
                    limits.open[self._address] = left
                else:
                    limits.open.pop(self._address, None)
                self._address = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._waiting_for != "header":  # the next request on a kept-alive one
                self._arm("header", limits.header_timeout_s)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()
            self._arm("body", limits.body_timeout_s)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, what: str, after_s: float) -> None:
            self._disarm()
            self._waiting_for = what
            self._timer = self.loop.call_later(after_s, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting_for = None, ""

        def _expired(self) -> None:
            what, self._timer = self._waiting_for, None
            address = self.client[0] if self.client else ""
            limits.note(f"{what}_timeout", address, f"closed a connection whose request's "
                        f"{what} did not come in time")
            cycle: Any = self.cycle
            if cycle is not None and cycle.response_started:
                self.transport.close()  # too late for a status: the app answered
            else:
                self._refuse(HEADER_TIMEOUT if what == "header" else BODY_TIMEOUT)

        def send_400_response(self, msg: str) -> None:  # a request it could not parse
            address = self.client[0] if self.client else ""
            limits.note("malformed", address, "refused a request that is not valid HTTP")
            self._refuse(MALFORMED)

        def _refuse(self, response: bytes) -> None:
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    return Bounded


class _Unparsed(logging.Filter):
    """Drops uvicorn's line for a request it could not parse (``Bounded`` says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != UNPARSED


UNPARSED_FILTER = _Unparsed()
