"""The worker's background loops on the supervisor: the load exchange survives the
exceptions redis-py leaks, a critical loop that keeps failing makes /readyz 503 naming
it, and stopping never raises. Against the real Redis Cluster of the test session."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.service.supervise import Backoff, Supervisor
from tests.support.worker import Harness
from worker.routing.lease import EngineSpec, LoadView
from worker.routing.loadshare import LoadExchange
from worker.routing.router import Router

pytestmark = pytest.mark.integration

FAST = Backoff(base_s=0.01, cap_s=0.05)


async def until(cond: Callable[[], object], within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("leaked", [AttributeError, TypeError])
async def test_the_load_exchange_survives_what_redis_py_leaks(
    redis: RedisCluster, leaked: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    ns = f"t{uuid.uuid4().hex[:6]}"
    router = Router([EngineSpec(id="e1", url="http://127.0.0.1:9", cap=8)])
    ex = LoadExchange(redis, router, "wleak", namespace=ns, interval_s=0.02, stale_s=0.05)
    reg = CollectorRegistry()
    sup = Supervisor(reg, backoff=FAST, unhealthy_after=3)
    real_tick = ex.tick
    failing = True

    async def tick() -> LoadView:
        if failing:  # what redis-py 8 raises from a connection closed under a command
            raise leaked("'NoneType' object has no attribute 'write'")
        return await real_tick()

    ex.tick = tick  # type: ignore[method-assign]
    await ex.start(sup)
    try:
        with caplog.at_level(logging.ERROR, "relay.service.supervise"):
            await until(lambda: ex.errors >= 4)
        assert sup.not_ready() == ["load_exchange_failing"]
        assert any("load_exchange" in r.getMessage() and r.exc_info for r in caplog.records)
        # a view older than stale_s gave way to the static split (alone: the whole cap)
        assert router.snapshot()["engines"]["e1"]["effective_cap"] == 8
        failing = False
        await until(lambda: ex.ticks >= 2)  # the same loop goes on: it was never dead
        assert sup.not_ready() == []
        assert reg.get_sample_value("tokenrelay_loop_failures_total", {"loop": "load_exchange"})
        assert reg.get_sample_value("tokenrelay_loop_healthy", {"loop": "load_exchange"}) == 1
    finally:
        await sup.stop()
        await ex.stop()
    assert await redis.zscore(f"{ns}:workers", "wleak") is None  # withdrawn


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


async def test_stopping_the_load_exchange_never_raises_when_redis_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gone = GatedRedisCluster(host="127.0.0.1", port=_dead_port(), socket_connect_timeout=0.5)
    router = Router([EngineSpec(id="e1", url="http://127.0.0.1:9", cap=4)])
    ex = LoadExchange(gone, router, "wgone", interval_s=0.05)
    await ex.start()  # a supervisor of its own
    try:
        await asyncio.sleep(0.2)
        with caplog.at_level(logging.WARNING):
            await ex.stop()  # withdraws: fails, logged, not raised
        assert any("withdraw" in r.getMessage() for r in caplog.records)
    finally:
        await gone.aclose()


async def test_readyz_names_a_critical_loop_that_keeps_failing(h: Harness) -> None:
    await h.start_engines(1)
    st = await h.start_worker(load_exchange=True)
    assert h.http is not None
    assert st.exchange is not None
    async with h.http.get(h.url("/readyz")) as r:
        assert r.status == 200, await r.text()
    real_tick = st.exchange.tick
    broken = True

    async def tick() -> LoadView:
        if broken:
            raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")
        return await real_tick()

    st.exchange.tick = tick  # type: ignore[method-assign]
    body: dict[str, object] = {}
    for _ in range(200):
        async with h.http.get(h.url("/readyz")) as r:
            body = await r.json()
            if r.status == 503:
                break
        await asyncio.sleep(0.05)
    assert body["error"] == "load_exchange_failing", body
    assert body["reasons"] == ["load_exchange_failing"]
    assert body["reason"] == "background loop load_exchange keeps failing"
    async with h.http.get(h.url("/healthz")) as r:
        assert r.status == 200  # alive: not ready is not dead
    async with h.http.get(h.url("/metrics")) as r:
        text = await r.text()
    assert 'tokenrelay_loop_healthy{loop="load_exchange"} 0.0' in text
    broken = False
    for _ in range(400):
        async with h.http.get(h.url("/readyz")) as r:
            if r.status == 200:
                break
        await asyncio.sleep(0.05)
    assert r.status == 200
    # draining comes first, with the loops' reasons after it
    st.turns.draining = True
    async with h.http.get(h.url("/readyz")) as r:
        body = await r.json()
    assert (r.status, body["error"], body["reasons"]) == (503, "draining", ["draining"])


async def test_cleanup_closes_everything_even_when_a_step_fails(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    await h.start_engines(1)
    st = await h.start_worker(load_exchange=True)
    assert st.exchange is not None

    async def withdraw() -> None:
        raise RuntimeError("withdraw broke")

    st.exchange.withdraw = withdraw  # type: ignore[method-assign]
    loops = [lp.task for lp in st.supervisor.loops.values()]
    assert all(t is not None and not t.done() for t in loops)
    assert h.server is not None
    with caplog.at_level(logging.ERROR, "worker.lifecycle"):
        await h.server.close()  # the app's cleanup
    h.server = None
    assert st.http.closed  # closed after the failing step, not skipped
    assert all(t is not None and t.done() for t in loops)  # every loop stopped
    assert any("cleanup step failed" in r.getMessage() for r in caplog.records)
