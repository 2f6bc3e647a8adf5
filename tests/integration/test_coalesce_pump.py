"""The coalescer's pump in real time: batches go out in order, a quiet stream is flushed
by the timer (the pure coalescer's rules: tests/unit/test_coalesce.py)."""

from __future__ import annotations

import asyncio

from relay.producer.coalesce import Batch, CoalescePolicy, TokenPump


async def test_pump_publishes_in_order_and_flushes_on_close():
    out: list[Batch] = []

    async def publish(b: Batch) -> None:
        await asyncio.sleep(0.001)
        out.append(b)

    pump = TokenPump(publish, CoalescePolicy(max_tokens=3, max_delay_s=0.03))
    task = asyncio.create_task(pump.run())
    for i in range(10):
        pump.push(str(i))
        await asyncio.sleep(0.002)
    pump.close()
    await asyncio.wait_for(task, 2)
    assert "".join(b.text for b in out) == "0123456789"
    assert sum(b.count for b in out) == 10
    assert pump.published_tokens == 10
    assert len(out) < 10


async def test_pump_timer_flushes_a_quiet_stream():
    out: list[Batch] = []

    async def publish(b: Batch) -> None:
        out.append(b)

    pump = TokenPump(publish, CoalescePolicy(max_tokens=100, max_delay_s=0.02))
    task = asyncio.create_task(pump.run())
    pump.push("a")  # immediate
    pump.push("b")
    await asyncio.sleep(0.1)
    assert [b.text for b in out] == ["a", "b"]
    pump.close()
    await asyncio.wait_for(task, 1)
