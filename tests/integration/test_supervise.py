"""The supervised-loop type every background loop runs on (relay.service.supervise).

In-process asyncio, no Redis, in real time (the loops' backoff): failures are raised by
the steps themselves, including the exception types redis-py leaks on a closed
connection, which the one error mapper turns into RedisUnavailable.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import pytest
import redis.exceptions as rex
from prometheus_client import CollectorRegistry

from relay.broker.errors import RedisUnavailable
from relay.service.supervise import Backoff, Supervisor


async def until(cond: Callable[[], object], within_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def sample(reg: CollectorRegistry, name: str, loop: str) -> float:
    value = reg.get_sample_value(name, {"loop": loop})
    return 0.0 if value is None else value


FAST = Backoff(base_s=0.001, cap_s=0.004)


def test_backoff_grows_is_bounded_and_jittered() -> None:
    b = Backoff(base_s=0.1, cap_s=2.0)
    rng = random.Random(7)
    assert b.delay(0, rng) == 0.0
    for n in range(1, 30):
        d = min(2.0, 0.1 * 2 ** (n - 1))
        got = [b.delay(n, rng) for _ in range(50)]
        assert all(d / 2 <= x <= d for x in got)
        assert len(set(got)) > 1  # jittered: processes that failed together spread out
    with pytest.raises(ValueError):
        Backoff(base_s=0, cap_s=1)


async def test_a_failing_step_is_logged_retried_and_makes_the_process_not_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reg = CollectorRegistry()
    sup = Supervisor(reg, backoff=FAST, unhealthy_after=3)
    calls = 0
    fail = True

    async def step() -> None:
        nonlocal calls
        calls += 1
        if fail:
            raise KeyError("a bug in the step")

    sup.every("exchange", 0.001, step)
    await until(lambda: calls >= 4)
    assert sup.not_ready() == ["exchange_failing"]
    assert sample(reg, "tokenrelay_loop_healthy", "exchange") == 0
    assert sample(reg, "tokenrelay_loop_failures_total", "exchange") >= 3
    bug_logs = [r for r in caplog.records if "exchange" in r.getMessage()]
    assert bug_logs
    assert all(r.exc_info for r in bug_logs)
    fail = False
    await until(lambda: not sup.not_ready())
    assert sample(reg, "tokenrelay_loop_healthy", "exchange") == 1
    await sup.stop()


async def test_redis_py_leaks_reach_the_loop_as_one_line_outages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = Supervisor(CollectorRegistry(), backoff=FAST, unhealthy_after=1)
    seen: list[str] = []

    async def step() -> None:
        seen.append("x")
        if len(seen) == 1:
            raise rex.ConnectionError("Error 111 connecting to 10.0.0.1:6379")
        raise RedisUnavailable("redis did not answer")

    sup.every("presence", 0.001, step, critical=False)
    await until(lambda: len(seen) >= 2)
    await sup.stop()
    lines = [r for r in caplog.records if "presence" in r.getMessage()]
    assert lines
    assert not any(r.exc_info for r in lines)
    assert all("RedisUnavailable" in r.getMessage() for r in lines)
    assert sup.not_ready() == []  # not critical: logged and counted, never "not ready"


async def test_a_forever_loop_that_ends_is_started_again_and_counted() -> None:
    reg = CollectorRegistry()
    sup = Supervisor(reg, backoff=FAST, unhealthy_after=5)
    runs = 0

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise ConnectionResetError("peer went away")
        await asyncio.Event().wait()  # the third run keeps running

    sup.forever("subscriber", run)
    await until(lambda: runs == 3)
    assert sample(reg, "tokenrelay_loop_restarts_total", "subscriber") == 2
    assert sup.not_ready() == []
    await sup.stop()
    assert sup.loops["subscriber"].task is None


async def test_a_forever_loop_is_healthy_again_once_it_runs_stable() -> None:
    sup = Supervisor(CollectorRegistry(), backoff=FAST, unhealthy_after=2, stable_s=0.05)
    runs = 0

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs <= 2:
            raise OSError("refused")
        await asyncio.Event().wait()

    sup.forever("sync", run)
    await until(lambda: runs == 3)
    assert sup.not_ready() == ["sync_failing"]
    await until(lambda: not sup.not_ready())
    await sup.stop()


async def test_conditions_and_spawned_task_failures(caplog: pytest.LogCaptureFixture) -> None:
    sup = Supervisor(CollectorRegistry())
    sup.set_condition("redis_unreachable", True)
    assert sup.not_ready() == ["redis_unreachable"]
    sup.set_condition("redis_unreachable", False)
    assert sup.not_ready() == []

    async def boom() -> None:
        raise ValueError("lost in a task")

    with caplog.at_level(logging.ERROR):
        task = sup.spawn("fire-and-forget", boom())
        await asyncio.wait([task])
        await asyncio.sleep(0)
    assert any("fire-and-forget" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_stop_never_raises_even_when_a_loop_fails_while_stopping(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = Supervisor(CollectorRegistry(), backoff=FAST)

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup failed")

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(10)

    runs = 0

    async def swallows_cancel() -> None:
        nonlocal runs
        runs += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ValueError("turned its cancellation into an error") from None

    sup.forever("stubborn", stubborn)
    sup.forever("swallower", swallows_cancel)
    sup.spawn("slow", slow_to_stop())
    await asyncio.sleep(0.01)
    await sup.stop(timeout_s=0.1)  # does not raise, does not hang
    await asyncio.sleep(0.05)
    assert runs == 1  # a loop that swallowed its cancellation is not started again
    assert all(lp.task is None for lp in sup.loops.values())
    text = caplog.text
    assert "stubborn" in text
    assert "slow" in text
    with pytest.raises(ValueError):
        sup.every("x", 0, stubborn)


async def test_two_loops_cannot_share_a_name() -> None:
    sup = Supervisor(CollectorRegistry())

    async def idle() -> None:
        await asyncio.Event().wait()

    sup.forever("one", idle)
    with pytest.raises(ValueError):
        sup.forever("one", idle)
    await sup.stop()
