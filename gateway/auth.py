"""Who is calling, for which tenant, and within which limits.

* Auth is on when the gateway is told to require it, or as soon as any API key has
  ever been created (a revoked key keeps it on: revoking every key must not open
  the service). Off, every caller is tenant ``default``.
* ``Authorization: Bearer sk-<id>.<secret>`` names a key; the secret is checked in
  constant time against the salted hash. A valid key is remembered for
  ``cache_s``, so a revocation takes effect within that time on every gateway.
* A key that failed is remembered as failed for ``cache_s`` too, and each client
  address may fail ``failed_lookups`` lookups per ``FAILED_WINDOW_S``: past that it gets
  429 before any query, so keys made up at random cost the store nothing. A key that
  was valid on this gateway in the last day is still looked up: wrong keys never lock
  out a known valid one. Behind a proxy the address is the client's that a trusted
  proxy names (``GATEWAY_TRUSTED_PROXIES``), else the proxy's.
* Limits are per key, requests and tokens per minute, as token buckets kept in
  Postgres, so they hold across any number of gateway processes; a charge the store
  would refuse is refused without asking it (``gateway.limits``). A turn is charged its
  prompt (characters / 4) plus ``max_tokens`` (or ``DEFAULT_COMPLETION_TOKENS``) when
  it is accepted.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from psycopg_pool import AsyncConnectionPool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import keys
from gateway.dependencies import from_store
from gateway.errors import APIError, api_error
from gateway.limits import Buckets, Taken
from gateway.problems import Problem

T = TypeVar("T")
DEFAULT_TENANT = "default"
DEFAULT_COMPLETION_TOKENS = 512
UNLIMITED = math.inf
# How long a key found valid passes an address's wrong-key lockout (still looked up).
GOOD_KEY_S = 24 * 3600.0
# The window over which a client address's failed key lookups are counted.
FAILED_WINDOW_S = 10.0


@dataclass(frozen=True)
class Caller:
    tenant: str
    key_id: str | None = None
    rpm: int | None = None
    tpm: int | None = None

    @property
    def limited(self) -> bool:
        return self.key_id is not None and (self.rpm is not None or self.tpm is not None)


OPEN = Caller(DEFAULT_TENANT)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def _reset(limit: float, left: float) -> str:
    return f"{max(limit - left, 0) * 60 / limit:.3f}s" if math.isfinite(limit) else "0s"


class Guard:
    def __init__(self, pool: AsyncConnectionPool, require: bool, cache_s: float = 2.0,
                 timeout_s: float = 5.0, failed_lookups: int = 20,
                 refused: Callable[[str], None] = lambda _: None) -> None:
        self.pool = pool
        self.timeout_s = timeout_s  # auth and limits need the store: 503 when it is away
        self.require = require
        self.cache_s = cache_s
        self.failed_lookups = failed_lookups
        self._enabled: tuple[float, bool] = (0.0, require)
        self._known: dict[bytes, tuple[float, Caller]] = {}
        self._refused: dict[bytes, float] = {}  # keys that failed, when
        self._good: dict[bytes, float] = {}  # keys found valid, when (past the lockout)
        self._failures: dict[str, tuple[float, int]] = {}  # per address: window, failures
        # Reads of the store under way, shared by every request that needs the same one:
        # when a cached answer expires under load, one query goes out, not one per request
        # (10,000 streams opened at once queued 10,000 for the pool, and got 503s).
        self._asking: dict[object, asyncio.Future[Any]] = {}
        self.buckets = Buckets(self._take, refused)  # rate limits

    async def _once(self, what: object, ask: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``ask()``, or the same call already under way for ``what``."""
        task = self._asking.get(what)
        if task is None:
            task = self._asking[what] = asyncio.ensure_future(ask())
            task.add_done_callback(lambda done: self._asked(what, done))
        answer: T = await asyncio.shield(task)
        return answer

    def _asked(self, what: object, done: asyncio.Future[Any]) -> None:
        self._asking.pop(what, None)
        if not done.cancelled():
            done.exception()  # each waiter has it; marked seen even if all of them left

    async def enabled(self) -> bool:
        checked, on = self._enabled
        if self.require or time.monotonic() - checked < self.cache_s:
            return on
        return await self._once("enabled", self._read_enabled)

    async def _read_enabled(self) -> bool:
        async with from_store(self.pool, self.timeout_s) as conn:
            row = await (await conn.execute("SELECT EXISTS (SELECT 1 FROM api_keys)")).fetchone()
        on = bool(row and row[0])
        self._enabled = (time.monotonic(), on)
        return on

    async def identify(self, authorization: str | None, address: str = "") -> Caller:
        """The caller a request's ``Authorization`` header names (401 if it must and
        does not; 429 if ``address`` failed too often of late)."""
        if not await self.enabled():
            return OPEN
        if not authorization:
            raise _unauthorized("You didn't provide an API key: send it as "
                                "'Authorization: Bearer <key>'.")
        scheme, _, presented = authorization.partition(" ")
        parts = keys.split(presented.strip()) if scheme.lower() == "bearer" else None
        if parts is None:
            raise _unauthorized("Incorrect API key provided.")
        fingerprint = hashlib.sha256(presented.strip().encode()).digest()
        now = time.monotonic()
        cached = self._known.get(fingerprint)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        if now - self._refused.get(fingerprint, -math.inf) < self.cache_s:
            raise _unauthorized("Incorrect API key provided.")
        if now - self._good.get(fingerprint, -math.inf) >= GOOD_KEY_S:
            self._check_failures(address, now)
        key_id, secret = parts
        caller = await self._once(fingerprint, lambda: self._lookup(key_id, secret))
        if caller is None:
            self._failed(fingerprint, address)
            raise _unauthorized("Incorrect API key provided.")
        if len(self._known) > 10_000:
            self._known.clear()
        self._known[fingerprint] = (time.monotonic(), caller)
        if len(self._good) > 100_000:
            self._good = {f: at for f, at in self._good.items() if now - at < GOOD_KEY_S}
            if len(self._good) > 100_000:
                self._good.clear()
        self._good[fingerprint] = time.monotonic()
        return caller

    def _check_failures(self, address: str, now: float) -> None:
        began, failures = self._failures.get(address, (now, 0))
        if now - began >= FAILED_WINDOW_S:
            self._failures.pop(address, None)
        elif failures >= self.failed_lookups:
            retry = max(math.ceil(began + FAILED_WINDOW_S - now), 1)
            raise APIError(429, f"Too many incorrect API keys from this address "
                           f"({failures} in {FAILED_WINDOW_S:g} s); retry after {retry} s.",
                           code="too_many_failed_keys", headers={"Retry-After": str(retry)})

    def _failed(self, fingerprint: bytes, address: str) -> None:
        now = time.monotonic()
        if len(self._refused) > 10_000:
            self._refused = {f: at for f, at in self._refused.items()
                             if now - at < self.cache_s}
            if len(self._refused) > 10_000:
                self._refused.clear()
        self._refused[fingerprint] = now
        if len(self._failures) > 100_000:
            self._failures.clear()
        began, failures = self._failures.get(address, (now, 0))
        self._failures[address] = (began, failures + 1)

    async def _lookup(self, key_id: str, secret: str) -> Caller | None:
        async with from_store(self.pool, self.timeout_s) as conn:
            row = await (await conn.execute(
                "SELECT tenant, salt, hash, rpm, tpm, revoked_at FROM api_keys WHERE id = %s",
                (key_id,))).fetchone()
        salt, stored = (row[1], row[2]) if row is not None else keys.decoy()
        valid = await asyncio.to_thread(keys.matches, bytes(salt), bytes(stored), secret)
        if row is None or not valid or row[5] is not None:
            return None
        return Caller(row[0], key_id, row[3], row[4])

    async def charge(self, caller: Caller, requests: int, tokens: int) -> dict[str, str]:
        """Take from the caller's buckets; the ``x-ratelimit-*`` headers to answer with,
        or a 429 with ``Retry-After`` when a bucket holds too little."""
        if not caller.limited:
            return {}
        rpm = float(caller.rpm) if caller.rpm is not None else UNLIMITED
        tpm = float(caller.tpm) if caller.tpm is not None else UNLIMITED
        assert caller.key_id is not None
        taken = await self.buckets.charge(caller.key_id, rpm, tpm, float(requests),
                                          float(tokens))
        requests_left, tokens_left = taken.requests_left, taken.tokens_left
        headers = {}
        for kind, limit, left in (("requests", rpm, requests_left), ("tokens", tpm, tokens_left)):
            if math.isfinite(limit):
                headers[f"x-ratelimit-limit-{kind}"] = str(int(limit))
                headers[f"x-ratelimit-remaining-{kind}"] = str(max(int(left), 0))
                headers[f"x-ratelimit-reset-{kind}"] = _reset(limit, left)
        if taken.granted:
            return headers
        if tokens > tpm:
            message = (f"This request needs about {tokens} tokens, more than this key's "
                       f"limit of {int(tpm)} tokens per minute.")
        else:
            kind = "tokens" if tokens and tokens_left < tokens else "requests"
            message = f"Rate limit reached for {kind} per minute on this API key."
        retry = min(max(math.ceil(taken.wait_s), 1), 60)
        raise APIError(429, message, code="rate_limit_exceeded",
                       headers={**headers, "Retry-After": str(retry)})


    async def _take(self, key_id: str, rpm: float, tpm: float, requests: float,
                    tokens: float) -> Taken:
        async with from_store(self.pool, self.timeout_s) as conn:
            row = await (await conn.execute(
                "SELECT granted, requests_left, tokens_left, wait_s"
                " FROM take_from_buckets(%s, %s, %s, %s, %s)",
                (key_id, rpm, tpm, requests, tokens))).fetchone()
        assert row is not None
        return Taken(*row)


def estimate_tokens(prompt_chars: int, max_tokens: int | None) -> int:
    """What a turn is charged against tokens per minute when it is accepted."""
    return prompt_chars // 4 + (max_tokens or DEFAULT_COMPLETION_TOKENS)


class Authenticate:
    """ASGI middleware: every ``/v1`` request names its caller (``request.state.caller``),
    is charged one request, and carries its key's ``x-ratelimit-*`` headers."""

    # Reads or changes only the start of a response (``gateway.eventstream.ServerSend``).
    START_ONLY = True

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        guard: Guard = scope["app"].state.resources.guard
        header = dict(scope["headers"]).get(b"authorization")
        try:
            client = scope.get("client")
            caller = await guard.identify(header.decode("latin-1") if header else None,
                                          client[0] if client else "")
            limits = await guard.charge(caller, requests=1, tokens=0)
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        except Problem as exc:  # the store is away: who calls cannot be told
            await api_error(exc).response()(scope, receive, send)
            return
        scope.setdefault("state", {})["caller"] = caller
        extra = [(k.encode(), v.encode()) for k, v in limits.items()]
        if not extra:  # no limits to tell: every message of a stream goes straight on
            await self.app(scope, receive, send)
            return

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_limits)
