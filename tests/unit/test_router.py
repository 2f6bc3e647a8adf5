"""The pure router core: ring, bounded loads, spill, leases, membership, full cluster."""

from __future__ import annotations

import asyncio
import math

import mmh3
import pytest

from worker.routing.key import routing_key
from worker.routing.lease import AllEnginesFull, EngineSpec, LeaseState, LoadView
from worker.routing.ring import Ring, key_hash
from worker.routing.router import Router
from worker.routing.wait import route_wait


def specs(n: int, cap: int = 100, weight: float = 1.0) -> list[EngineSpec]:
    return [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=cap, weight=weight) for i in range(n)]


KEYS = [f"session-{i}" for i in range(5000)]


def test_key_hash_is_32bit_unsigned_murmur3() -> None:
    assert key_hash("abc") == mmh3.hash("abc", 0, signed=False)
    assert 0 <= key_hash("anything") < 2**32


def test_ring_lists_every_owner_once_clockwise_from_each_vnode() -> None:
    vnodes = {"a": 10, "b": 20, "c": 5}  # weights 1, 2 and 0.5 at 10 vnodes
    ring = Ring([("a", 1.0, "A"), ("b", 2.0, "B"), ("c", 0.5, "C")], vnodes=10)
    assert ring.hashes == sorted(key_hash(f"{e}#{i}") for e, n in vnodes.items() for i in range(n))
    for i, succ in enumerate(ring.succ):
        assert sorted(succ) == ["A", "B", "C"]
        after = ring.succ[(i + 1) % len(ring.succ)]  # the next vnode's list, minus this owner
        assert [o for o in after if o != succ[0]] == list(succ[1:])
    h = key_hash("k")
    first = next((i for i, x in enumerate(ring.hashes) if x >= h), 0)  # wraps past the last
    assert ring.successors("k") == ring.succ[first]
    assert Ring((), vnodes=10).hashes == []


def test_same_key_same_engine_when_idle() -> None:
    r = Router(specs(8))
    for k in KEYS[:200]:
        with r.route(k) as lease:
            assert lease.engine.id == r.preferred(k) == lease.preferred
            assert not lease.spilled


def test_vnodes_spread_keys_roughly_evenly() -> None:
    r = Router(specs(8), vnodes=160)
    counts: dict[str, int] = {}
    for k in KEYS:
        counts[r.preferred(k)] = counts.get(r.preferred(k), 0) + 1
    assert max(counts.values()) / (len(KEYS) / 8) < 1.35


def test_weight_scales_share_of_keys() -> None:
    r = Router([*specs(3), EngineSpec(id="big", url="x", cap=100, weight=3.0)])
    share = sum(r.preferred(k) == "big" for k in KEYS) / len(KEYS)
    assert 0.4 < share < 0.6  # 3 of 6 weight units


def test_adding_engine_moves_only_keys_to_the_new_engine() -> None:
    r = Router(specs(8))
    before = {k: r.preferred(k) for k in KEYS}
    r.add_engine(EngineSpec(id="new", url="x", cap=100))
    moved = [k for k in KEYS if r.preferred(k) != before[k]]
    assert all(r.preferred(k) == "new" for k in moved)
    assert 0.05 < len(moved) / len(KEYS) < 0.2  # about 1/9


def test_removing_engine_moves_only_its_keys() -> None:
    r = Router(specs(8))
    before = {k: r.preferred(k) for k in KEYS}
    r.remove_engine("e3")
    for k in KEYS:
        if before[k] != "e3":
            assert r.preferred(k) == before[k]
        else:
            assert r.preferred(k) != "e3"


def test_drain_sends_keys_where_removal_will_send_them() -> None:
    r = Router(specs(6))
    held = r.route(next(k for k in KEYS if r.preferred(k) == "e2"))
    r.drain_engine("e2")
    drained = {k: r.route(k) for k in KEYS[:300]}
    assert all(lease.engine.id != "e2" for lease in drained.values())
    for lease in drained.values():
        lease.release()
    r2 = Router(specs(6))
    r2.remove_engine("e2")
    for k in KEYS[:300]:
        with r.route(k) as a, r2.route(k) as b:
            assert a.engine.id == b.engine.id
    assert r.snapshot()["engines"]["e2"]["in_flight"] == 1
    held.release()
    assert r.snapshot()["engines"]["e2"]["in_flight"] == 0


def test_fixed_cap_spills_to_next_distinct_engine_clockwise() -> None:
    r = Router(specs(4, cap=2), eps=100.0, spill="walk")
    key = "hot"
    first = [r.route(key) for _ in range(2)]
    assert {x.engine.id for x in first} == {r.preferred(key)}
    third = r.route(key)
    assert third.spilled
    assert third.preferred == r.preferred(key)
    ring = r._ring
    i = ring.hashes.index(next(h for h in ring.hashes if h >= key_hash(key)))
    assert third.engine.id == ring.succ[i][1].spec.id


def test_bounded_load_rule_caps_engine_at_ceil_1_plus_eps_mean() -> None:
    r = Router(specs(4, cap=1000), eps=0.25)
    leases = [r.route("same-key") for _ in range(400)]
    loads = r.in_flight()
    total = sum(loads.values())
    assert total == 400
    assert max(loads.values()) <= math.ceil(1.25 * total / 4)
    for x in leases:
        x.release()


@pytest.mark.parametrize("spill", ["walk", "least_loaded"])
def test_full_cluster_raises_with_retry_after(spill: str) -> None:
    r = Router(specs(3, cap=2), eps=100.0, spill=spill)
    leases = [r.route(f"k{i}") for i in range(6)]
    with pytest.raises(AllEnginesFull) as info:
        r.route("one-more")
    assert 0.05 <= info.value.retry_after_s <= 30.0
    assert r.snapshot()["counters"]["rejections"] == 1
    leases[0].release()
    r.route("one-more").release()


def test_least_loaded_spill_picks_lowest_ratio() -> None:
    r = Router(specs(4, cap=3), eps=100.0, spill="least_loaded")
    pref = r.preferred("hot")
    hot = [r.route("hot") for _ in range(3)]
    others = [e.id for e in r.engines() if e.id != pref]
    busy = [r.route(k) for k in [k for k in KEYS if r.preferred(k) == others[0]][:2]]
    mid = [r.route(k) for k in [k for k in KEYS if r.preferred(k) == others[1]][:1]]
    lease = r.route("hot")
    assert lease.spilled
    assert lease.engine.id == others[2]
    for x in [*hot, *busy, *mid, lease]:
        x.release()


def test_lease_released_exactly_once_second_is_counted_noop() -> None:
    r = Router(specs(2))
    lease = r.route("k")
    assert lease.state is LeaseState.HELD
    assert lease.release() is True
    assert lease.release() is False
    assert lease.state in {LeaseState.RELEASED}
    snap = r.snapshot()
    assert snap["counters"]["double_releases"] == 1
    assert sum(e["in_flight"] for e in snap["engines"].values()) == 0


def test_context_manager_releases_on_error() -> None:
    r = Router(specs(2))
    with pytest.raises(RuntimeError), r.route("k"):
        raise RuntimeError("engine failed")
    assert sum(r.in_flight().values()) == 0


def test_set_engines_reconciles_membership() -> None:
    r = Router(specs(4))
    lease = r.route("k")
    r.set_engines([*specs(3), EngineSpec(id="e9", url="x", cap=5)])
    assert {e.id for e in r.engines()} == {"e0", "e1", "e2", "e9"}
    lease.release()  # releasing on a removed engine is harmless
    r.set_engines([EngineSpec(id="e0", url="y", cap=7), *specs(3)[1:]])
    snap = r.snapshot()["engines"]
    assert snap["e0"]["cap"] == 7
    assert snap["e0"]["effective_cap"] == 7
    assert r.snapshot()["counters"]["in_flight"] == 0


def test_no_engines_is_a_full_cluster() -> None:
    r = Router([])
    with pytest.raises(AllEnginesFull):
        r.route("k")


def test_load_view_lowers_effective_cap_and_counts_others() -> None:
    r = Router(specs(2, cap=10), eps=100.0)
    r.apply_load_view(LoadView(others={"e0": 8, "e1": 8}, allowance={"e0": 1, "e1": 1}))
    snap = r.snapshot()["engines"]
    assert snap["e0"]["effective_cap"] == 1
    assert snap["e0"]["others"] == 8
    a, b = r.route("x"), r.route("y")
    assert {a.engine.id, b.engine.id} == {"e0", "e1"}
    with pytest.raises(AllEnginesFull):
        r.route("z")
    r.apply_load_view(None)
    r.route("z").release()


def test_invalid_specs_rejected() -> None:
    with pytest.raises(ValueError, match="cap"):
        EngineSpec(id="a", url="x", cap=0)
    with pytest.raises(ValueError, match="duplicate"):
        Router([*specs(1), *specs(1)])
    with pytest.raises(ValueError, match="spill"):
        Router(specs(1), spill="random")


async def test_route_wait_gets_slot_when_lease_released() -> None:
    r = Router(specs(1, cap=1), eps=100.0)
    held = r.route("a")
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, held.release)
    lease = await route_wait(r, "b", deadline_s=2.0)
    assert lease.engine.id == "e0"
    lease.release()


def test_a_load_view_that_frees_room_wakes_the_waiters() -> None:
    r = Router(specs(2, cap=4), eps=100.0)
    woken: list[int] = []
    r.add_release_listener(lambda: woken.append(1))
    r.apply_load_view(LoadView(others={"e0": 1}, allowance={"e0": 0, "e1": 0}))
    assert woken == []  # less room: nobody to wake
    r.apply_load_view(LoadView(others={"e0": 1}, allowance={"e0": 0, "e1": 0}))
    assert woken == []  # the same view: nothing changed
    r.apply_load_view(LoadView(others={"e0": 1}, allowance={"e0": 0, "e1": 1}))
    assert woken == [1]  # a larger allowance
    r.apply_load_view(LoadView(others={}, allowance={"e0": 0, "e1": 1}))
    assert woken == [1, 1]  # another worker released its slot


async def test_route_wait_is_admitted_when_the_load_view_grants_a_share() -> None:
    r = Router(specs(1, cap=4), eps=100.0)
    r.apply_load_view(LoadView(others={}, allowance={"e0": 0}))  # a newcomer's first view
    with pytest.raises(AllEnginesFull):
        r.route("b")
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, r.apply_load_view, LoadView(others={}, allowance={"e0": 2}))
    lease = await route_wait(r, "b", deadline_s=5.0)
    assert lease.engine.id == "e0"
    lease.release()


async def test_route_wait_raises_after_deadline() -> None:
    r = Router(specs(1, cap=1), eps=100.0)
    held = r.route("a")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(AllEnginesFull):
        await route_wait(r, "b", deadline_s=0.1)
    assert 0.09 <= loop.time() - t0 < 1.0
    held.release()


def test_routing_key_stable_across_turns_and_distinct_across_sessions() -> None:
    sys_prompt = "You are a helpful assistant. " * 50
    turn1 = [{"role": "user", "content": "Tell me about hash rings"}]
    turn3 = [
        *turn1,
        {"role": "assistant", "content": "Sure. " * 100},
        {"role": "user", "content": "more"},
    ]
    assert routing_key(sys_prompt, turn1, prefix_chars=30) == routing_key(
        sys_prompt, turn3, prefix_chars=30
    )
    other = [{"role": "user", "content": "Write a poem about Redis"}]
    assert routing_key(sys_prompt, turn1) != routing_key(sys_prompt, other)
    assert routing_key(sys_prompt, turn1, prefix_chars=0) == routing_key(
        sys_prompt, other, prefix_chars=0
    )
    assert len(routing_key(sys_prompt, turn3)) <= 32 + 1 + 256
    assert routing_key(None, ["hi"]) != routing_key("sys", ["hi"])


def test_routing_key_ignores_the_reply_after_a_short_first_message() -> None:
    turn1 = [{"role": "user", "content": "hi"}]
    turn2: list[dict[str, str] | str] = [
        *turn1,
        {"role": "assistant", "content": "Hello! How can I help?"},
        "explain",
    ]
    assert routing_key("sys", turn1) == routing_key("sys", turn2)
    assert routing_key("sys", turn1).endswith("user:hi\x1f")


def test_round_robin_baseline_ignores_the_key_but_keeps_the_caps() -> None:
    r = Router(specs(3, cap=2), policy="round_robin")
    leases = [r.route("same key") for _ in range(6)]
    assert [lease.engine.id for lease in leases] == ["e0", "e1", "e2"] * 2
    with pytest.raises(AllEnginesFull):
        r.route("same key")
    leases[1].release()
    again = r.route("other key")
    assert again.engine.id == "e1"
    r.drain_engine("e0")
    for lease in [*leases, again]:
        lease.release()
    assert {r.route(f"k{i}").engine.id for i in range(4)} == {"e1", "e2"}
    with pytest.raises(ValueError, match="policy"):
        Router(specs(1), policy="random")
