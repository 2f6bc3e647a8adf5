"""Load sharing across workers: the pure allowance rule, then the Redis exchange for real."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from redis.asyncio import RedisCluster

from worker.loadshare import LoadExchange, WorkerReport, compute_view, static_view, worker_key
from worker.router import AllEnginesFull, EngineSpec, Router

CAPS = {"e0": 16, "e1": 16}


def test_worker_key_uses_worker_id_as_hash_tag() -> None:
    assert worker_key("w-1") == "tr:workers:{w-1}"
    with pytest.raises(ValueError, match="invalid"):
        worker_key("a}b")


def test_static_view_splits_cap_exactly() -> None:
    workers = ["a", "b", "c"]
    total = sum(static_view({"e": 16}, workers, me).allowance["e"] for me in workers)
    assert total == 16
    assert static_view({"e": 16}, [], "alone").allowance["e"] == 16


def test_alone_a_worker_gets_the_whole_cap() -> None:
    view = compute_view(CAPS, {"e0": 3}, {}, [])
    assert view.allowance == {"e0": 16, "e1": 16}
    assert view.others == {"e0": 0, "e1": 0}


def test_idle_workers_split_free_capacity() -> None:
    peers = [WorkerReport("b", {}, {}, {}), WorkerReport("c", {}, {}, {})]
    view = compute_view({"e": 30}, {}, {}, peers)
    assert view.allowance["e"] == 10


def test_demand_takes_the_free_capacity() -> None:
    busy_peer = WorkerReport("b", {"e": 0}, {"e": 20}, {"e": 0})
    mine = compute_view({"e": 32}, {"e": 0}, {}, [busy_peer])
    assert mine.allowance["e"] <= 2  # the peer that wants it gets nearly all of it


def test_others_reservations_are_respected() -> None:
    peer = WorkerReport("b", {"e": 4}, {"e": 4}, {"e": 12})
    view = compute_view({"e": 16}, {"e": 2}, {}, [peer])
    assert view.others["e"] == 4
    assert view.allowance["e"] <= 16 - 12
    assert view.allowance["e"] >= 2  # never below what this worker already holds


def test_sum_of_allowances_never_exceeds_cap_with_sequential_exchanges() -> None:
    rng = random.Random(3)
    cap, workers = 24, 4
    held = [0] * workers
    allowance = [0] * workers
    reports: dict[int, WorkerReport] = {}
    for _ in range(5000):
        w = rng.randrange(workers)
        # traffic between exchanges: admit up to the allowance, finish some
        held[w] = max(0, min(allowance[w], held[w] + rng.randint(-3, 6)))
        others = [r for i, r in reports.items() if i != w]
        pressure = rng.randint(0, 5)
        view = compute_view({"e": cap}, {"e": held[w]}, {"e": pressure}, others)
        allowance[w] = view.allowance["e"]
        reports[w] = WorkerReport(
            f"w{w}", {"e": held[w]}, {"e": held[w] + pressure}, {"e": allowance[w]}
        )
        assert allowance[w] >= held[w]
        assert sum(max(h, a) for h, a in zip(held, allowance, strict=True)) <= cap


def test_router_obeys_the_view() -> None:
    router = Router([EngineSpec(id="e", url="x", cap=8)], eps=100.0)
    peer = WorkerReport("b", {"e": 5}, {"e": 5}, {"e": 6})
    view = compute_view({"e": 8}, router.in_flight(), {"e": 20}, [peer])
    router.apply_load_view(view)
    assert 1 <= view.allowance["e"] <= 8 - 6
    leases = [router.route(f"k{i}") for i in range(view.allowance["e"])]
    with pytest.raises(AllEnginesFull):
        router.route("k9")
    for lease in leases:
        lease.release()


def _specs() -> list[EngineSpec]:
    return [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=12) for i in range(2)]


@pytest.mark.integration
async def test_exchange_shares_cap_between_workers_through_redis(redis: RedisCluster) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    ra, rb = Router(_specs(), eps=100.0), Router(_specs(), eps=100.0)
    xa = LoadExchange(redis, ra, "wa", namespace=ns)
    xb = LoadExchange(redis, rb, "wb", namespace=ns)
    try:
        await xa.tick()  # alone: the whole cap
        assert ra.snapshot()["engines"]["e0"]["effective_cap"] == 12
        keys = [k for k in [f"k{i}" for i in range(400)] if ra.preferred(k) == "e0"][:7]
        held = [ra.route(k) for k in keys]
        assert {lease.engine.id for lease in held} == {"e0"}
        await xa.tick()
        await xb.tick()
        assert xb.peers == ["wa"]
        snap_b = rb.snapshot()["engines"]["e0"]
        assert snap_b["others"] == 7
        assert snap_b["effective_cap"] <= 12 - 7
        raw = await redis.hgetall(worker_key("wa", ns))
        assert {k.decode() if isinstance(k, bytes) else k for k in raw} == {
            "in_flight",
            "demand",
            "allowance",
        }
        assert 0 < await redis.pttl(worker_key("wa", ns)) <= 1500
        # a worker that stops is forgotten by its peers at their next exchange
        for lease in held:
            lease.release()
        await xa.stop()
        await xb.tick()
        assert xb.peers == []
        assert rb.snapshot()["engines"]["e0"]["effective_cap"] == 12
    finally:
        await xa.stop()
        await xb.stop()


@pytest.mark.integration
async def test_exchange_loop_runs_in_background(redis: RedisCluster) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    router = Router(_specs())
    ex = LoadExchange(redis, router, "wloop", namespace=ns, interval_s=0.05)
    await ex.start()
    try:
        for _ in range(100):
            if ex.ticks >= 3:
                break
            await asyncio.sleep(0.02)
        assert ex.ticks >= 3
        assert ex.errors == 0
    finally:
        await ex.stop()
    assert await redis.exists(worker_key("wloop", ns)) == 0
