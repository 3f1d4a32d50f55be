"""The worker's fair share between tenants (``workers.fairness``), as a unit: which
waiting prompt starts next, given what each tenant has been served."""

from __future__ import annotations

import pytest

from bench.fairness import jain
from workers.fairness import OUTPUT_COST, FairQueue
from workers.settings import WorkerSettings, parse_weights


def queue(**kwargs: object) -> FairQueue[tuple[str, int]]:
    return FairQueue(lambda item: item[0], **kwargs)  # type: ignore[arg-type]


def serve(q: FairQueue[tuple[str, int]], slots: int, steps: int, tokens_per_turn: int,
          arrivals: dict[int, list[tuple[str, int]]] | None = None
          ) -> tuple[dict[str, int], dict[tuple[str, int], int]]:
    """Run ``q`` as a worker of ``slots`` slots would, one token per running turn per
    step: the tokens each tenant got, and the step each item started at."""
    running: dict[tuple[str, int], int] = {}
    tokens: dict[str, int] = {}
    started: dict[tuple[str, int], int] = {}
    for step in range(steps):
        for item in (arrivals or {}).get(step, []):
            q.push(item)
        while len(running) < slots and (item := q.pop()) is not None:
            running[item] = tokens_per_turn
            started[item] = step
            q.served(item[0], prompt_tokens=10)
        for item in list(running):
            tokens[item[0]] = tokens.get(item[0], 0) + 1
            q.served(item[0], output_tokens=1)
            running[item] -= 1
            if not running[item]:
                del running[item]
                q.ended(item[0])
    return tokens, started


def test_a_tenant_that_comes_later_starts_before_the_backlog_of_one_that_came_first() -> None:
    q = queue()
    arrivals = {0: [("alpha", i) for i in range(200)], 5: [("beta", i) for i in range(10)]}
    tokens, started = serve(q, slots=8, steps=400, tokens_per_turn=20, arrivals=arrivals)
    # In log order beta's first turn would wait for 192 of alpha's: 24 rounds of 20 steps.
    beta_starts = sorted(s for (tenant, _), s in started.items() if tenant == "beta")
    assert beta_starts[0] <= 20 and beta_starts[-1] <= 60, beta_starts
    # While both wait, the slots are shared: beta's ten turns against alpha's.
    assert tokens["beta"] == 10 * 20


def test_shares_follow_the_weights_and_are_fair_among_equals() -> None:
    equal = queue()
    arrivals = {0: [(t, i) for i in range(100) for t in ("a", "b", "c")]}
    tokens, _ = serve(equal, slots=6, steps=300, tokens_per_turn=10, arrivals=arrivals)
    assert jain([float(tokens[t]) for t in "abc"]) > 0.99, tokens
    weighted = queue(weights={"gold": 3.0})
    arrivals = {0: [(t, i) for i in range(300) for t in ("gold", "free")]}
    tokens, _ = serve(weighted, slots=8, steps=400, tokens_per_turn=10, arrivals=arrivals)
    assert 2.5 <= tokens["gold"] / tokens["free"] <= 3.5, tokens


def test_an_idle_tenant_banks_no_credit() -> None:
    q = queue()
    q.served("alpha", output_tokens=10_000)  # alpha has been busy for a long time
    q.push(("alpha", 1))
    q.push(("beta", 1))  # beta arrives while alpha waits: lifted to alpha's counter
    assert q.counters["beta"] == q.counters["alpha"] == 10_000 * OUTPUT_COST
    assert q.pop() == ("alpha", 1)  # a tie goes to the one that waited first
    assert q.pop() == ("beta", 1)


def test_a_tenant_at_its_cap_leaves_the_slots_to_others() -> None:
    q = queue(max_running=2)
    for i in range(5):
        q.push(("alpha", i))
    assert [q.pop(), q.pop(), q.pop()] == [("alpha", 0), ("alpha", 1), None]
    q.push(("beta", 0))
    assert q.pop() == ("beta", 0)
    q.ended("alpha")
    assert q.pop() == ("alpha", 2)
    assert len(q) == 2


def test_a_conversations_turns_keep_their_order_and_removal_keeps_the_counts() -> None:
    q: FairQueue[tuple[str, int]] = FairQueue(lambda item: item[0], size_of=lambda item: 10)
    for i in range(6):
        q.push(("alpha" if i % 2 else "beta", i))
    q.remove(lambda item: item[1] in (2, 3))
    assert len(q) == 4 and q.size == 40
    popped = [q.pop() for _ in range(4)]
    assert [p for p in popped if p and p[0] == "alpha"] == [("alpha", 1), ("alpha", 5)]
    assert q.pop() is None and q.size == 0


def test_tenant_weights_are_parsed_or_refused_by_name() -> None:
    assert parse_weights(" gold=4, free=0.5 ,") == {"gold": 4.0, "free": 0.5}
    for bad in ("gold", "gold=0", "=2", "gold=-1", "gold=nan", "gold=inf", "gold=x"):
        with pytest.raises(ValueError, match="tenant=<a positive number>"):
            parse_weights(bad)
    with pytest.raises(ValueError):
        WorkerSettings(tenant_weights="gold=zero")


def test_in_log_order_a_tenant_that_comes_later_waits_behind_the_backlog() -> None:
    """The worker's order before the fair share (``WORKER_SCHEDULING=fifo``): what the
    fair share is measured against."""
    q = queue(fair=False)
    arrivals = {0: [("alpha", i) for i in range(200)], 5: [("beta", i) for i in range(10)]}
    _, started = serve(q, slots=8, steps=600, tokens_per_turn=20, arrivals=arrivals)
    beta_starts = sorted(s for (tenant, _), s in started.items() if tenant == "beta")
    assert beta_starts[0] >= 24 * 20, beta_starts  # after alpha's 192 waiting turns
