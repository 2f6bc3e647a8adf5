"""The relay-wide byte budget's per-key shares (relay.edge.fanout.budget.ByteBudget): a
key (a client address) holds at most its share, and its reservations past that wait
without holding back another key's, which one address's readers that never read used to
do to every other client's catch-up reads."""

from __future__ import annotations

import asyncio

from relay.edge.fanout.budget import ByteBudget


async def test_a_key_over_its_share_waits_and_others_go_first() -> None:
    b = ByteBudget(100, share=50)
    assert b.share == 50
    assert await b.acquire(30, "slow") == 30
    late = asyncio.create_task(b.acquire(30, "slow"))  # over its share: waits
    await asyncio.sleep(0)
    assert not late.done()
    assert await asyncio.wait_for(b.acquire(50, "other"), 1) == 50  # not behind it
    assert await asyncio.wait_for(b.acquire(10), 1) == 10  # nor is a keyless one
    b.release(30, "slow")
    assert await asyncio.wait_for(late, 1) == 30
    assert b.used == 90
    b.release(30, "slow")
    b.release(50, "other")
    b.release(10)
    assert b.used == 0


async def test_a_reservation_is_at_most_a_share_and_the_default_share_is_a_quarter() -> None:
    b = ByteBudget(64 << 20)
    assert b.share == 16 << 20
    assert await b.acquire(32 << 20, "a") == 16 << 20
    assert await b.acquire(32 << 20) == 32 << 20  # keyless: up to the whole budget


async def test_the_whole_budget_still_binds_in_order() -> None:
    b = ByteBudget(100, share=60)
    assert await b.acquire(60, "a") == 60
    first = asyncio.create_task(b.acquire(50, "b"))  # waits for the total
    await asyncio.sleep(0)
    second = asyncio.create_task(b.acquire(30, "c"))  # fits, but comes after: waits too
    await asyncio.sleep(0)
    assert not first.done()
    assert not second.done()
    b.release(60, "a")
    assert await asyncio.wait_for(first, 1) == 50
    assert await asyncio.wait_for(second, 1) == 30
