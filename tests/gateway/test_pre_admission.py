"""Large prompts take turns by tenant: a tenant's deep queue delays another's prompt by one turn."""

from __future__ import annotations

import asyncio

from gateway.pre_admission import FairSlots


async def test_waiting_tenants_are_served_in_turn_not_in_arrival_order() -> None:
    slots = FairSlots(1)
    order: list[str] = []
    gate = asyncio.Event()

    async def work(tenant: str, tag: str) -> None:
        async with slots.slot(tenant):
            order.append(tag)
            await gate.wait()

    first = asyncio.create_task(work("flood", "f0"))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(work("flood", f"f{i}")) for i in range(1, 5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(work("victim", "v")))  # arrives after four of the flood's
    await asyncio.sleep(0)
    assert slots.waiting("flood") == 4 and slots.waiting("victim") == 1
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order[:3] == ["f0", "f1", "v"]  # one flood prompt at most, then the victim's turn
    assert sorted(order) == ["f0", "f1", "f2", "f3", "f4", "v"]


async def test_a_waiter_cancelled_leaves_no_slot_taken() -> None:
    slots = FairSlots(1)
    held = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        async with slots.slot("a"):
            held.set()
            await release.wait()

    holder = asyncio.create_task(hold())
    await held.wait()
    waiter = asyncio.create_task(slots._acquire("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert slots.waiting("b") == 0
    release.set()
    await holder
    async with asyncio.timeout(1):  # the slot came back: a new caller gets it at once
        async with slots.slot("c"):
            pass
