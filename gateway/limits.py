"""Rate limits that cost the store nothing to refuse.

A key's limits are token buckets in PostgreSQL (``take_from_buckets``: one atomic call
takes a charge or refuses it), exact across any number of gateways. Each gateway keeps
what the store last said of each key's buckets, as of when it asked (``Seen``). Other
gateways only take from a bucket, so that level, refilled at the key's rate since, is an
upper bound of what the bucket holds now: a charge it cannot cover would be refused by
the store too, and is refused here without asking (**429** as the store's, its headers
from that bound). A charge it covers goes to the store, which decides.

While the bound would cover a charge only if the charges this gateway has at the store
now are refused, the charge waits for their answers instead of asking too: 300 requests
at once on a key allowed 3 a minute cost the store about 3 calls, not 300, and a flood
of refusals never holds the pool that every other tenant's requests use
(``gateway_rate_limit_refusals{by}`` counts refusals made here and by the store).

What the store said is kept ``FRESH_S``: the projector gives back what a turn was
charged and did not use, which no bound here sees, so a key refused here is asked about
again within that time.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# How long what the store said of a key is believed (see the module).
FRESH_S = 1.0
# Keys whose buckets are remembered, at most (the oldest are forgotten first).
REMEMBERED = 100_000


@dataclass(frozen=True)
class Taken:
    """The store's answer to a charge, or one made here in its place."""

    granted: bool
    requests_left: float
    tokens_left: float
    wait_s: float
    here: bool = False  # refused without asking the store


@dataclass
class Seen:
    """A key's buckets as the store last said, and its charges at the store now."""

    requests: float = math.nan  # nan: not yet asked
    tokens: float = math.nan
    asked_at: float = 0.0  # when the question that was answered so went out
    asking: int = 0
    requests_asked: float = 0.0  # of the charges being asked about
    tokens_asked: float = 0.0
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def levels(self, now: float, rpm: float, tpm: float) -> tuple[float, float]:
        """At most what the buckets hold at ``now`` (see the module)."""
        elapsed = max(now - self.asked_at, 0.0)
        return _refilled(self.requests, rpm, elapsed), _refilled(self.tokens, tpm, elapsed)


def _wait(wanted: float, left: float, per_minute: float) -> float:
    """Seconds until a bucket of ``per_minute`` holding ``left`` holds ``wanted``."""
    return (wanted - left) * 60 / per_minute if left < wanted else 0.0


def _refilled(level: float, per_minute: float, elapsed_s: float) -> float:
    if math.isinf(per_minute):
        return math.inf
    return min(per_minute, level + elapsed_s * per_minute / 60)


Take = Callable[[str, float, float, float, float], Awaitable[Taken]]


class Buckets:
    """``take(key_id, rpm, tpm, requests, tokens)`` asks the store (see the module);
    ``refused(by)`` counts each refusal, made ``"here"`` or by the ``"store"``."""

    def __init__(self, take: Take, refused: Callable[[str], None] = lambda _: None) -> None:
        self._take = take
        self._refused = refused
        self._seen: dict[str, Seen] = {}

    async def charge(self, key_id: str, rpm: float, tpm: float, requests: float,
                     tokens: float) -> Taken:
        while True:
            seen = self._seen.get(key_id)
            now = time.monotonic()
            if seen is None or (now - seen.asked_at > FRESH_S and not seen.asking):
                seen = self._remember(key_id)
            known, covered = not math.isnan(seen.requests), False
            if known:
                left_requests, left_tokens = seen.levels(now, rpm, tpm)
                if left_requests < requests or left_tokens < tokens:
                    self._refused("here")
                    wait = max(_wait(requests, left_requests, rpm), _wait(tokens, left_tokens, tpm))
                    return Taken(False, left_requests, left_tokens, wait, here=True)
                covered = (left_requests - seen.requests_asked >= requests
                           and left_tokens - seen.tokens_asked >= tokens)
            if seen.asking and not covered:
                await seen.answered.wait()  # then decide again, on their answers
                continue
            return await self._ask(key_id, seen, rpm, tpm, requests, tokens)

    def _remember(self, key_id: str) -> Seen:
        self._seen.pop(key_id, None)
        if len(self._seen) >= REMEMBERED:  # forget the oldest (dicts keep their order)
            for old in list(self._seen)[:REMEMBERED // 10]:
                if not self._seen[old].asking:
                    del self._seen[old]
        seen = self._seen[key_id] = Seen()
        return seen

    async def _ask(self, key_id: str, seen: Seen, rpm: float, tpm: float, requests: float,
                   tokens: float) -> Taken:
        asked_at = time.monotonic()
        seen.asking += 1
        seen.requests_asked += requests
        seen.tokens_asked += tokens
        try:
            taken = await self._take(key_id, rpm, tpm, requests, tokens)
        finally:
            seen.asking -= 1
            seen.requests_asked -= requests
            seen.tokens_asked -= tokens
            answered, seen.answered = seen.answered, asyncio.Event()
            answered.set()
        # Bounds from each answer, as of now: several may be out, and the lowest holds.
        now = time.monotonic()
        answer = Seen(taken.requests_left, taken.tokens_left, asked_at).levels(now, rpm, tpm)
        if not math.isnan(seen.requests):
            before = seen.levels(now, rpm, tpm)
            answer = (min(answer[0], before[0]), min(answer[1], before[1]))
        seen.requests, seen.tokens, seen.asked_at = *answer, now
        if not taken.granted:
            self._refused("store")
        return taken
