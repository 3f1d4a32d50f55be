"""Rate limits refused without the store (``gateway.limits``), as a unit: the store's
``take_from_buckets`` is played by a bucket in memory with its semantics, shared by the
gateways of a test; the integration tests (``test_security``) run it on PostgreSQL."""

from __future__ import annotations

import asyncio
import time

from gateway.limits import Buckets, Taken


class Store:
    """``take_from_buckets``: refilled at the limit's rate per minute, all or nothing."""

    def __init__(self, delay_s: float = 0.005) -> None:
        self.delay_s = delay_s
        self.levels: dict[str, tuple[float, float, float]] = {}  # requests, tokens, at
        self.calls = 0

    async def take(self, key: str, rpm: float, tpm: float, requests: float,
                   tokens: float) -> Taken:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        now = time.monotonic()
        r, k, at = self.levels.get(key, (rpm, tpm, now))
        r, k = min(rpm, r + (now - at) * rpm / 60), min(tpm, k + (now - at) * tpm / 60)
        granted = r >= requests and k >= tokens
        if granted:
            r, k = r - requests, k - tokens
        self.levels[key] = (r, k, now)
        wait = max((requests - r) * 60 / rpm, (tokens - k) * 60 / tpm, 0.0)
        return Taken(granted, r, k, wait)


def test_a_flood_on_a_limited_key_costs_the_store_a_few_calls() -> None:
    store, refused = Store(), list[str]()
    buckets = Buckets(store.take, refused.append)

    async def flood() -> list[Taken]:
        return await asyncio.gather(*(buckets.charge("k", 3, 1e9, 1, 0) for _ in range(300)))

    answers = asyncio.run(flood())
    assert sum(t.granted for t in answers) == 3
    assert store.calls <= 4, store.calls  # 3 granted, then one refusal at most
    assert refused.count("here") >= 296 and all(t.wait_s > 0 for t in answers
                                                if not t.granted)


def test_gateways_together_never_grant_past_the_limit() -> None:
    """Four gateways on one store, each sent 50 charges at once, twice: what the store
    holds is the only grant, so 10 a minute stays 10."""
    store = Store()
    gateways = [Buckets(store.take) for _ in range(4)]

    async def rounds() -> int:
        granted = 0
        for _ in range(2):
            answers = await asyncio.gather(*(g.charge("k", 10, 1e9, 1, 0)
                                             for g in gateways for _ in range(50)))
            granted += sum(t.granted for t in answers)
        return granted

    assert asyncio.run(rounds()) == 10


def test_what_the_store_would_grant_is_never_refused_here() -> None:
    """A bucket that refills is asked again once the bound says it could cover the
    charge; and one the store credited (a turn's charge given back) is asked again
    within FRESH_S."""
    store = Store(delay_s=0)
    buckets = Buckets(store.take)

    async def scenario() -> tuple[bool, bool, bool]:
        first = await buckets.charge("k", 6000, 1e9, 100, 0)  # 100 a second back
        emptied = await buckets.charge("k", 6000, 1e9, 5900, 0)
        await asyncio.sleep(0.06)  # about 6 back: one request of 5 fits
        refilled = await buckets.charge("k", 6000, 1e9, 5, 0)
        return first.granted, emptied.granted, refilled.granted

    assert asyncio.run(scenario()) == (True, True, True)

    credited = Buckets(store.take)

    async def credit() -> tuple[bool, bool]:
        await credited.charge("c", 1, 1000, 0, 1000)
        refused = await credited.charge("c", 1, 1000, 0, 500)
        r, _, at = store.levels["c"]
        store.levels["c"] = (r, 1000, at)  # the projector gave the tokens back
        await asyncio.sleep(1.1)
        again = await credited.charge("c", 1, 1000, 0, 900)  # 18 tokens refilled: not
        return refused.granted, again.granted             # enough without the credit

    assert asyncio.run(credit()) == (False, True)


def test_unlimited_sides_and_debts_are_kept_exactly() -> None:
    store = Store(delay_s=0)
    buckets = Buckets(store.take)

    async def scenario() -> list[Taken]:
        answers = [await buckets.charge("u", float("inf"), 100, 1, 60) for _ in range(2)]
        store.levels["u"] = (float("inf"), -50, time.monotonic())  # a true-up past it
        answers.append(await buckets.charge("u", float("inf"), 100, 1, 0))
        return answers

    first, second, indebted = asyncio.run(scenario())
    assert first.granted and first.requests_left == float("inf")
    assert not second.granted and second.here  # 40 left of 100, 60 asked
    assert 11 < second.wait_s < 13  # 20 more tokens at 100 a minute
    assert not indebted.granted  # the store says the same of a bucket in debt
