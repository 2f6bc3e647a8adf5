"""The mock engine's parts that need no server: its FIFO admission gate and its command's
flags (the engine over real HTTP: tests/integration/test_mock_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import FifoGate


async def test_fifo_gate_admits_in_arrival_order() -> None:
    gate = FifoGate(1)
    await gate.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await gate.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert (gate.running, gate.waiting) == (1, 3)
    for _ in range(3):
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (gate.running, gate.waiting) == (1, 0)
    gate.release()
    assert gate.running == 0


async def test_fifo_gate_passes_on_a_slot_handed_to_a_cancelled_waiter() -> None:
    gate = FifoGate(1)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    second = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # hands the slot to `first` ...
    first.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert (gate.running, gate.waiting) == (1, 0)


def test_cli_reply_flags_reach_the_engine_and_bad_ones_exit_2() -> None:
    import argparse

    from devstack.mockengine.cli import config_from_args, register, run

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["engine", "--port", "0", "--reply-mean-tokens", "50", "--reply-max-tokens", "80"]
    )
    assert config_from_args(args).reply == ReplyLength(mean=50, max_tokens=80)
    bad = parser.parse_args(["engine", "--port", "0", "--reply-max-tokens", "0"])
    assert run(bad) == 2


def test_cli_kv_events_flags_reach_the_engine_and_are_off_by_default() -> None:
    import argparse

    from devstack.mockengine.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    off = config_from_args(parser.parse_args(["engine", "--port", "0"]))
    assert off.kv_events_port is None
    on = config_from_args(parser.parse_args(["engine", "--port", "0", "--kv-events-port", "5557"]))
    assert (on.kv_events_port, on.kv_events_replay_port) == (5557, None)
