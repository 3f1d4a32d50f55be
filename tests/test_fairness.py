"""The worker's fair share between tenants (``workers.fairness``), as a unit: which
waiting prompt starts next, given what each tenant has been served."""

from __future__ import annotations

import pytest

from bench.fairness import jain
from workers import fairness
from workers.fairness import OUTPUT_COST, FairQueue
from workers.settings import WorkerSettings, parse_weights


def queue(**kwargs: object) -> FairQueue[tuple[str, int]]:
    return FairQueue(lambda item: item[0], **kwargs)  # type: ignore[arg-type]


def serve(q: FairQueue[tuple[str, int]], slots: int, steps: int, tokens_per_turn: int,
          arrivals: dict[int, list[tuple[str, int]]] | None = None, preempt: bool = False
          ) -> tuple[dict[str, int], dict[tuple[str, int], int], int]:
    """Run ``q`` as a worker of ``slots`` slots would, one token per running turn per
    step: the tokens each tenant got, the step each item first started at, and how many
    turns were stopped. With ``preempt``, slots are taken back as the worker does: when
    every slot is taken and ``victim()`` names a tenant, its newest turn is stopped and
    waits again, keeping the tokens it had."""
    running: dict[tuple[str, int], int] = {}  # in start order: tokens left
    left: dict[tuple[str, int], int] = {}  # of the turns stopped
    tokens: dict[str, int] = {}
    started: dict[tuple[str, int], int] = {}
    stopped = 0
    for step in range(steps):
        for arrived in (arrivals or {}).get(step, []):
            q.push(arrived)
        while True:
            while len(running) < slots and (popped := q.pop()) is not None:
                running[popped] = left.pop(popped, tokens_per_turn)
                started.setdefault(popped, step)
                q.served(popped[0], prompt_tokens=10)
            tenant = q.victim() if preempt and len(running) >= slots and q else None
            if tenant is None:
                break
            newest = next(i for i in reversed(running) if i[0] == tenant)
            left[newest] = running.pop(newest)
            q.ended(tenant)
            q.requeue(newest)
            stopped += 1
        for item in list(running):
            tokens[item[0]] = tokens.get(item[0], 0) + 1
            q.served(item[0], output_tokens=1)
            running[item] -= 1
            if not running[item]:
                del running[item]
                q.ended(item[0])
    return tokens, started, stopped


def test_a_tenant_that_comes_later_starts_before_the_backlog_of_one_that_came_first() -> None:
    q = queue()
    arrivals = {0: [("alpha", i) for i in range(200)], 5: [("beta", i) for i in range(10)]}
    tokens, started, _ = serve(q, slots=8, steps=400, tokens_per_turn=20, arrivals=arrivals)
    # In log order beta's first turn would wait for 192 of alpha's: 24 rounds of 20 steps.
    beta_starts = sorted(s for (tenant, _), s in started.items() if tenant == "beta")
    assert beta_starts[0] <= 20 and beta_starts[-1] <= 60, beta_starts
    # While both wait, the slots are shared: beta's ten turns against alpha's.
    assert tokens["beta"] == 10 * 20


def test_shares_follow_the_weights_and_are_fair_among_equals() -> None:
    equal = queue()
    arrivals = {0: [(t, i) for i in range(100) for t in ("a", "b", "c")]}
    tokens, _, _ = serve(equal, slots=6, steps=300, tokens_per_turn=10, arrivals=arrivals)
    assert jain([float(tokens[t]) for t in "abc"]) > 0.99, tokens
    weighted = queue(weights={"gold": 3.0})
    arrivals = {0: [(t, i) for i in range(300) for t in ("gold", "free")]}
    tokens, _, _ = serve(weighted, slots=8, steps=400, tokens_per_turn=10, arrivals=arrivals)
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
    _, started, _ = serve(q, slots=8, steps=600, tokens_per_turn=20, arrivals=arrivals)
    beta_starts = sorted(s for (tenant, _), s in started.items() if tenant == "beta")
    assert beta_starts[0] >= 24 * 20, beta_starts  # after alpha's 192 waiting turns


def test_slots_are_taken_back_for_a_tenant_below_its_share_and_never_thrash() -> None:
    """No cap: alpha's 200 long turns hold all 8 slots when beta's 10 come. Beta's first
    four start at once, each in a slot taken back from alpha (its share is 4 of 8),
    and alpha keeps its 4; nothing is taken back after, and every turn ends whole."""
    q = queue(slots=8)
    arrivals = {0: [("alpha", i) for i in range(200)], 5: [("beta", i) for i in range(10)]}
    tokens, started, stopped = serve(q, slots=8, steps=3000, tokens_per_turn=100,
                                     arrivals=arrivals, preempt=True)
    beta_starts = sorted(s for (tenant, _), s in started.items() if tenant == "beta")
    assert beta_starts[:4] == [5] * 4, beta_starts
    assert stopped == 4  # one per slot beta's share needed: no slot went back and forth
    assert tokens == {"alpha": 200 * 100, "beta": 10 * 100}  # each turn whole, once
    assert len(q) == 0 and not q.running


def test_alone_a_tenant_has_every_slot_and_nothing_is_taken_back() -> None:
    q = queue(slots=8)
    tokens, _, stopped = serve(q, slots=8, steps=500, tokens_per_turn=20,
                      arrivals={0: [("alpha", i) for i in range(100)]}, preempt=True)
    assert stopped == 0 and tokens == {"alpha": 100 * 20}


def test_shares_follow_weights_when_slots_are_taken_back() -> None:
    """Gold weighs 3: of 8 slots it is owed 6, free 2. Free's backlog holds all 8 first;
    gold takes six back, and free keeps two."""
    q = queue(slots=8, weights={"gold": 3.0})
    arrivals = {0: [("free", i) for i in range(100)], 3: [("gold", i) for i in range(100)]}
    _, started, stopped = serve(q, slots=8, steps=40, tokens_per_turn=1000, arrivals=arrivals,
                       preempt=True)
    assert sum(1 for (t, _), s in started.items() if t == "gold" and s == 3) == 6
    assert stopped == 6 and q.running == {"free": 2, "gold": 6}


def test_in_log_order_or_without_slots_nothing_is_taken_back() -> None:
    for q in (queue(fair=False, slots=8), queue()):
        for i in range(10):
            q.push(("alpha", i))
        while q.pop() is not None and sum(q.running.values()) < 8:
            pass
        q.push(("beta", 0))
        assert q.victim() is None


def test_memory_is_bounded_by_the_load_not_by_the_tenants_ever_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker serving one turn each for ever more tenants keeps the counters of the
    ``IDLE_REMEMBERED`` most recently idle only. The most recent keep what they were
    served (a heavy tenant back soon is still behind); one forgotten comes back at the
    active tenants' least counter, as it would have anyway."""
    monkeypatch.setattr(fairness, "IDLE_REMEMBERED", 50)
    q = queue(slots=4)
    q.push(("steady", 0))
    assert q.pop() == ("steady", 0)
    q.served("steady", prompt_tokens=100)
    for n in range(1_000):
        q.push((f"t{n}", n))
        assert q.pop() == (f"t{n}", n)
        q.served(f"t{n}", prompt_tokens=10 + n)
        q.ended(f"t{n}")
    assert len(q.counters) == 50 + 1  # the idle remembered, and the running tenant
    assert q.counters["t999"] == 100 + 1_009  # recently idle: kept, above the floor
    q.push(("t999", 1_000))
    q.push(("t0", 1_001))  # forgotten: lifted to the floor, the steady tenant's 100
    assert q.counters["t0"] == 100 and q.counters["t999"] == 1_109
    assert q.pop() == ("t0", 1_001)
