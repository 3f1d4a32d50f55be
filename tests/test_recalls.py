"""The memory service's recalls shared between tenants (``memory.recalls``), as a unit:
each recall holds its place for a step, as the engine and the search would."""

from __future__ import annotations

import asyncio

import pytest

from memory.recalls import Recalls, TenantBusy


def test_a_tenant_with_one_recall_waits_for_one_place_beside_a_flood() -> None:
    order: list[str] = []

    async def recall(recalls: Recalls, tenant: str, name: str) -> None:
        async with recalls.place(tenant):
            order.append(name)
            await asyncio.sleep(0.01)

    async def scenario() -> list[BaseException | None]:
        recalls = Recalls(concurrent=2, per_tenant=32)
        flood = [asyncio.create_task(recall(recalls, "alpha", f"a{i}")) for i in range(40)]
        await asyncio.sleep(0)
        beta = asyncio.create_task(recall(recalls, "beta", "b0"))
        results = await asyncio.gather(*flood, beta, return_exceptions=True)
        assert recalls.running == 0 and recalls.waiting() == 0
        return results

    results = asyncio.run(scenario())
    refused = [r for r in results if isinstance(r, TenantBusy)]
    assert len(refused) == 6  # 2 ran, 32 waited, the 6 past them were refused at once
    assert "MEMORY_MAX_WAITING_RECALLS_PER_TENANT" in str(refused[0])
    assert order.index("b0") <= 3, order  # after the 2 running and the next one of alpha's
    assert len(order) == 35


def test_a_recall_that_leaves_gives_its_place_on() -> None:
    async def scenario() -> int:
        recalls = Recalls(concurrent=1)
        held = asyncio.Event()

        async def holder() -> None:
            async with recalls.place("t"):
                held.set()
                await asyncio.sleep(0.05)

        first = asyncio.create_task(holder())
        await held.wait()
        leaving = asyncio.create_task(recalls.place("t").__aenter__())
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await first
        async with recalls.place("u"):  # free again at once
            pass
        return recalls.running

    assert asyncio.run(scenario()) == 0
