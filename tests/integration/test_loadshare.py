"""Load sharing across workers: the pure allowance rule, then the Redis exchange for real."""

from __future__ import annotations

import asyncio
import math
import random
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import RedisCluster

from relay.protocol.keys import worker_key
from worker.routing.lease import AllEnginesFull, EngineSpec
from worker.routing.loadshare import (
    LoadExchange,
    WorkerReport,
    compute_view,
    split_cap,
    static_view,
)
from worker.routing.router import Router
from worker.routing.wait import route_wait

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
    mine = compute_view({"e": 32}, {"e": 0}, {}, [busy_peer], "a")
    assert mine.allowance["e"] == 6  # the peer's 20 first, the other 12 split as footholds
    theirs = compute_view({"e": 32}, {"e": 0}, {"e": 20}, [WorkerReport("a", {}, {}, {})], "b")
    assert theirs.allowance["e"] == 26


def test_split_cap_meets_every_demand_that_fits_and_spreads_the_rest() -> None:
    assert split_cap(10, {"a": 2, "b": 0, "c": 0}, {"a": 1, "b": 4}) == {"a": 4, "b": 5, "c": 1}
    assert split_cap(8, {}, {}) == {}
    assert split_cap(8, {"a": 0}, {}) == {"a": 8}


def test_split_cap_under_overload_is_max_min_fair_and_rotates_with_the_epoch() -> None:
    assert split_cap(9, {"a": 0, "b": 0}, {"a": 2, "b": 30}) == {"a": 2, "b": 7}
    # cap 2, four workers all wanting: two of them per epoch, a different two over time
    held = {"a": 1, "b": 1, "c": 0, "d": 0}
    chosen = {w: 0 for w in held}
    for epoch in range(20):
        t = split_cap(2, held, dict.fromkeys(held, 1), epoch)
        assert sorted(t.values()) == [0, 0, 1, 1]
        assert t == split_cap(2, held, dict.fromkeys(held, 1), epoch)  # the same for all
        for w, v in t.items():
            chosen[w] += v
    assert min(chosen.values()) >= 4, chosen


@given(
    cap=st.integers(1, 64),
    workers=st.dictionaries(
        st.text("abcdefgh", min_size=1, max_size=3),
        st.tuples(st.integers(0, 40), st.integers(0, 40)),
        min_size=1,
        max_size=8,
    ),
)
def test_split_cap_properties(cap: int, workers: dict[str, tuple[int, int]]) -> None:
    held = {w: h for w, (h, _) in workers.items()}
    unmet = {w: u for w, (_, u) in workers.items()}
    t = split_cap(cap, held, unmet)
    demand = {w: held[w] + unmet[w] for w in workers}
    assert sum(t.values()) == cap
    assert all(v >= 0 for v in t.values())
    if sum(demand.values()) <= cap:
        assert all(t[w] >= demand[w] for w in workers)
    else:  # max-min fair: nobody short of its demand is more than one slot behind anyone
        assert all(t[w] <= demand[w] for w in workers)
        for w in workers:
            if t[w] < demand[w]:
                assert max(t.values()) <= t[w] + 1


def _rounds(cap: int, n: int, wants: list[int], rounds: int) -> list[list[int]]:
    """Sequential exchanges of ``n`` workers with constant unmet demand ``wants``; each
    admits up to its allowance and finishes its requests at the end of each round.
    Returns per round what each worker admitted."""
    allowance = [0] * n
    reports: dict[int, WorkerReport] = {}
    admitted: list[list[int]] = []
    for i in range(rounds):
        got = [0] * n
        for w in range(n):
            others = [r for j, r in reports.items() if j != w]
            view = compute_view({"e": cap}, {"e": 0}, {"e": wants[w]}, others, f"w{w}", i // 4)
            allowance[w] = view.allowance["e"]
            got[w] = min(wants[w], allowance[w])
            reports[w] = WorkerReport(f"w{w}", {"e": got[w]}, {"e": wants[w]}, {"e": allowance[w]})
            assert sum(r.allowance["e"] for r in reports.values()) <= cap
        admitted.append(got)
        for w in range(n):  # the round's requests finish
            r = reports[w]
            reports[w] = WorkerReport(r.worker_id, {"e": 0}, r.demand, r.allowance)
    return admitted


def test_an_idle_worker_among_more_workers_than_slots_gets_a_slot_in_two_rounds() -> None:
    # 4 workers, cap 2: the idle footholds sit with two of them; w3 wants one slot
    admitted = _rounds(2, 4, [0, 0, 0, 1], rounds=3)
    assert admitted[1][3] == 1, admitted


def test_under_overload_the_slots_rotate_and_nobody_starves() -> None:
    admitted = _rounds(2, 4, [5, 5, 5, 5], rounds=40)
    per_worker = [sum(r[w] for r in admitted) for w in range(4)]
    assert all(n >= 3 for n in per_worker), (per_worker, admitted)
    assert all(sum(r) <= 2 for r in admitted)


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


def test_with_a_queue_past_the_cap_allowances_still_sum_to_the_cap() -> None:
    """cost_aware holds up to allowance + floor(queue * allowance): the queue never enters
    the reservations, so allowances sum to at most the cap and what is in flight to at
    most (1 + queue) x cap, over 5,000 random sequential exchanges."""
    rng = random.Random(5)
    cap, workers, queue = 24, 4, 3.0
    held = [0] * workers
    allowance = [0] * workers
    reports: dict[int, WorkerReport] = {}
    for _ in range(5000):
        w = rng.randrange(workers)
        limit = allowance[w] + math.floor(queue * allowance[w])
        held[w] = max(0, min(limit, held[w] + rng.randint(-6, 12)))
        others = [r for i, r in reports.items() if i != w]
        pressure = rng.randint(0, 5)
        view = compute_view(
            {"e": cap},
            {"e": held[w]},
            {"e": pressure},
            others,
            f"w{w}",
            my_allowance={"e": allowance[w]},
            queue=queue,
        )
        allowance[w] = view.allowance["e"]
        reports[w] = WorkerReport(
            f"w{w}", {"e": held[w]}, {"e": held[w] + pressure}, {"e": allowance[w]}
        )
        assert held[w] <= allowance[w] + math.floor(queue * allowance[w])
        assert sum(allowance) <= cap
        assert sum(held) <= (1 + queue) * cap


def test_a_queueing_worker_above_its_target_gives_slots_back() -> None:
    """A worker holding 60 on an engine of cap 40 (its allowance 40, the rest queued) while
    another wants 20: its allowance shrinks to its fair share (20), not to what it holds,
    so the other gets a share (with reservations of what they hold it would keep all 40)."""
    peer = WorkerReport("b", {"e": 0}, {"e": 20}, {"e": 0})
    view = compute_view({"e": 40}, {"e": 60}, {}, [peer], "a", my_allowance={"e": 40}, queue=3.0)
    assert view.allowance["e"] == 20
    back = compute_view(
        {"e": 40},
        {"e": 0},
        {"e": 20},
        [WorkerReport("a", {"e": 60}, {"e": 60}, view.allowance)],
        "b",
    )
    assert back.allowance["e"] == 20


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


@pytest.mark.integration
async def test_a_newcomer_holds_no_share_for_a_round_and_a_waiting_route_gets_one(
    redis: RedisCluster,
) -> None:
    """The worker that ticked first reserved the whole cap; a worker that joins sees no
    free slot until its peer's next round. A turn there must wait, not fail."""
    ns = f"t{uuid.uuid4().hex[:8]}"
    specs = [EngineSpec(id="e0", url="http://e0", cap=2)]
    ra, rb = Router(specs, eps=100.0), Router(specs, eps=100.0)
    xa = LoadExchange(redis, ra, "wa", namespace=ns, interval_s=0.05)
    xb = LoadExchange(redis, rb, "wb", namespace=ns, interval_s=0.05)
    try:
        await xa.tick()
        await xb.tick()
        assert rb.snapshot()["engines"]["e0"]["effective_cap"] == 0
        with pytest.raises(AllEnginesFull):
            rb.route("k")  # the transient a bare 429 would expose
        await xa.start()
        await xb.start()
        lease = await route_wait(rb, "k", deadline_s=3.0)
        caps = [r.snapshot()["engines"]["e0"]["effective_cap"] for r in (ra, rb)]
        assert sum(caps) <= 2, caps  # the bound holds while the share moves
        lease.release()
    finally:
        await xa.stop()
        await xb.stop()
