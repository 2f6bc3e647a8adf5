"""The Router's cost_aware policy: the product side of worker/routing/cost.py."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.routing.cost import CostModel, CostProfile, TurnInfo, turn_info
from worker.routing.lease import EngineSpec, Lease, LeaseState, LoadView
from worker.routing.policy import DEFAULT_QUEUE, RouteReason
from worker.routing.router import Router


def _router(n: int = 3, cap: int = 4, queue: float = DEFAULT_QUEUE) -> Router:
    specs = [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=cap) for i in range(n)]
    return Router(specs, policy="cost_aware", queue=queue)


def test_a_session_returns_to_its_previous_engine_when_it_is_not_busy() -> None:
    r = _router()
    first = r.route("conv-a", turn=TurnInfo(prompt_tokens=8000, key="conv-a"))
    assert first.reason == "least_cost"
    first.first_token()
    first.release()
    nxt = TurnInfo(prompt_tokens=9000, key="conv-a", prev_engine=first.engine.id, prev_tokens=8400)
    again = r.route("conv-a", turn=nxt)
    assert again.engine.id == first.engine.id
    assert again.reason == "preferred"
    again.release()


def test_a_crowded_previous_engine_spills_the_turn() -> None:
    r = _router(cap=64)
    home = r.route("conv-a", turn=TurnInfo(prompt_tokens=2000, key="conv-a"))
    home.release()
    # other workers report 200 requests on the home engine: its batch and KV are full
    r.apply_load_view(LoadView(others={home.engine.id: 200}, allowance={}))
    turn = TurnInfo(prompt_tokens=2500, key="conv-a", prev_engine=home.engine.id, prev_tokens=2100)
    moved = r.route("conv-a", turn=turn)
    assert moved.engine.id != home.engine.id
    assert moved.reason == "spilled_cost"
    assert moved.spilled
    r.apply_load_view(None)
    moved.release()
    nxt = TurnInfo(prompt_tokens=3000, key="conv-a", prev_engine=moved.engine.id, prev_tokens=2600)
    back = r.route("conv-a", turn=nxt)  # the session meta now names the engine it moved to
    assert back.engine.id == moved.engine.id
    assert back.reason == "preferred"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 20_000), st.booleans()), max_size=60),
    st.integers(1, 4),
    st.sampled_from([None, "e0", "e1"]),
    st.sampled_from([0.0, 0.5, DEFAULT_QUEUE]),
)
def test_caps_hold_and_every_lease_is_released_exactly_once(
    ops: list[tuple[int, int, bool]], cap: int, drained: str | None, queue: float
) -> None:
    """Never more than cap + floor(queue * cap) in flight on an engine, and a lease past
    the cap says so (``queued_past_cap``); queue 0 is the plain cap."""
    r = _router(cap=cap, queue=queue)
    if drained:
        r.drain_engine(drained)
    r.apply_load_view(LoadView(others={"e2": 3}, allowance={"e2": max(1, cap - 1)}))
    held: list[Lease] = []
    for conv, tokens, release in ops:
        before = r.in_flight()
        lease = r.try_route(f"c{conv}", turn=TurnInfo(prompt_tokens=tokens, key=f"c{conv}"))
        if lease is not None:
            assert lease.engine.id != drained
            held.append(lease)
            lease.first_token()
            mine = max(1, cap - 1) if lease.engine.id == "e2" else cap
            past = before[lease.engine.id] >= mine
            assert (lease.reason == RouteReason.QUEUED_PAST_CAP) == past
        for eid, n in r.in_flight().items():
            mine = max(1, cap - 1) if eid == "e2" else cap
            assert n <= mine + math.floor(queue * mine)
        if release and held:
            lease = held.pop(0)
            assert lease.release()
            assert not lease.release()  # a second release is a counted no-op
    for lease in held:
        lease.release()
        assert lease.state is LeaseState.RELEASED
    assert r.in_flight() == {"e0": 0, "e1": 0, "e2": 0}
    assert r._cost is not None
    assert r._cost.in_flight() == {"e0": 0, "e1": 0, "e2": 0}


def test_avoid_and_full_engines_are_never_chosen() -> None:
    r = _router(n=2, cap=1, queue=0.0)
    a = r.route("k", turn=TurnInfo(prompt_tokens=100, key="k"))
    b = r.route("k", avoid=a.engine.id, turn=TurnInfo(prompt_tokens=100, key="k"))
    assert b.engine.id != a.engine.id
    assert r.try_route("k", turn=TurnInfo(prompt_tokens=100, key="k")) is None  # both full


def test_at_the_cap_a_turn_queues_at_the_cheapest_engine_up_to_the_allowance() -> None:
    """Both engines at their cap of 2: the next turns queue (``queued_past_cap``) until
    each holds 2 + floor(1.5 * 2) = 5; then the router refuses, as every cap used to."""
    r = _router(n=2, cap=2, queue=1.5)
    held = [r.route(f"k{i}", turn=TurnInfo(prompt_tokens=100, key=f"k{i}")) for i in range(4)]
    assert {lease.reason for lease in held} <= {"least_cost", "preferred", "spilled_cost"}
    for i in range(4, 10):
        lease = r.route(f"k{i}", turn=TurnInfo(prompt_tokens=100, key=f"k{i}"))
        assert lease.reason == RouteReason.QUEUED_PAST_CAP
        held.append(lease)
    assert r.in_flight() == {"e0": 5, "e1": 5}
    assert r.snapshot()["engines"]["e0"]["queued"] == 3
    assert r.try_route("k", turn=TurnInfo(prompt_tokens=100, key="k")) is None
    for lease in held:
        lease.release()
    assert r.in_flight() == {"e0": 0, "e1": 0}


def test_past_the_cap_a_turn_that_would_miss_the_ttft_slo_is_refused() -> None:
    """The queue takes a turn past the cap only when its expected time to the first token
    is within ``queue_slo_s``: a 100k-token prompt (about 4 s of prefill) waits instead."""
    specs = [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=1) for i in range(2)]
    r = Router(specs, policy="cost_aware", queue=3.0, queue_slo_s=2.0)
    for i in range(2):
        r.route(f"k{i}", turn=TurnInfo(prompt_tokens=100, key=f"k{i}")).first_token()
    small = r.try_route("s", turn=TurnInfo(prompt_tokens=100, key="s"))
    assert small is not None
    assert small.reason == RouteReason.QUEUED_PAST_CAP
    assert r.try_route("b", turn=TurnInfo(prompt_tokens=100_000, key="b")) is None
    loose = Router(specs, policy="cost_aware", queue=3.0, queue_slo_s=60.0)
    for i in range(2):
        loose.route(f"k{i}", turn=TurnInfo(prompt_tokens=100, key=f"k{i}"))
    assert loose.try_route("b", turn=TurnInfo(prompt_tokens=100_000, key="b")) is not None


def test_a_waiting_turn_is_demand_on_the_engine_the_cost_model_wants() -> None:
    """cost_aware's unmet demand goes to the engine it would choose (the session's, here),
    not to the ring's preferred engine for the key: that is the share it needs."""
    r = _router(n=4, cap=1, queue=0.0)
    home = r.route("conv", turn=TurnInfo(prompt_tokens=6000, key="conv"))
    home.first_token()
    home.release()
    for i in range(4):
        r.route(f"x{i}", turn=TurnInfo(prompt_tokens=10, key=f"x{i}"))
    turn = TurnInfo(prompt_tokens=7000, key="conv", prev_engine=home.engine.id, prev_tokens=6100)
    assert r.add_waiter("conv", turn) == home.engine.id
    assert r.take_unmet()[home.engine.id] == 1


def test_a_shared_prefix_in_flight_is_counted_once_in_the_kv_footprint() -> None:
    """300 turns on one 8k-token system prompt hold 8k tokens of it, not 2.4M: they add
    no KV-overflow recompute to the engine's cost (KV is 400k tokens)."""
    m = CostModel(["a", "b"])
    for i in range(300):
        t = TurnInfo(prompt_tokens=8600, shared_key="sys", shared_tokens=8192)
        m.admitted(i, replace(m.choose(t, allowed=["a"]), engine="a"), t)
        m.first_token(i)
    probe = TurnInfo(prompt_tokens=8600, shared_key="sys", shared_tokens=8192)
    wait = m.costs(probe, {})["a"][2]
    assert wait < 1.0  # 300 x 408 private tokens + 8k shared fit; no recompute term
    unshared = CostModel(["a"])
    for i in range(300):
        t = TurnInfo(prompt_tokens=8600)
        unshared.admitted(i, unshared.choose(t), t)
        unshared.first_token(i)
    assert unshared.costs(TurnInfo(prompt_tokens=8600), {})["a"][2] > 10 * wait


def test_a_session_stays_unless_leaving_saves_twice_its_history() -> None:
    """Moving a session recomputes its history elsewhere (and evicts as much cache there):
    with ``recompute_weight`` 2 (the default) it stays where a weight of 1 would move it."""
    for weight, stays in ((1.0, False), (2.0, True)):
        m = CostModel(["a", "b"], CostProfile(recompute_weight=weight))
        t0 = TurnInfo(prompt_tokens=4000, key="s", shared_key="sys", shared_tokens=1000)
        m.admitted(0, replace(m.choose(t0, allowed=["a"]), engine="a"), t0)
        m.admitted(1, replace(m.choose(t0, allowed=["b"]), engine="b"), t0)  # b has the prefix
        m.first_token(0)
        m.first_token(1)
        m.finished(0)
        m.finished(1)
        other = TurnInfo(prompt_tokens=4500, key="o")
        m.admitted(2, replace(m.choose(other, allowed=["a"]), engine="a"), other)  # queued on a
        turn = TurnInfo(prompt_tokens=4200, key="s", prev_engine="a", prev_tokens=4000,
                        shared_key="sys", shared_tokens=1000)  # fmt: skip
        assert (m.choose(turn).engine == "a") is stays, weight


def test_turn_info_estimates_from_characters_and_session_meta() -> None:
    hist = [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 400}]
    t = turn_info("sysdigest\x1fuser:hi", "s" * 800, hist, "z" * 40, "e1")
    assert t.prompt_tokens == (800 + 800 + 40) // 4
    assert t.prev_engine == "e1"
    assert t.prev_tokens == (800 + 800) // 4
    assert t.shared_key == "sysdigest"
    assert t.shared_tokens == 200
    assert turn_info("k", None, [], "hello", None).prev_tokens == 0


def test_caches_are_assumed_gone_after_a_kv_cache_worth_of_tokens() -> None:
    m = CostModel(["a", "b"])
    t = TurnInfo(prompt_tokens=5000, key="s")
    c = m.choose(t)
    m.admitted(0, c, t)
    m.finished(0)
    again = TurnInfo(prompt_tokens=6000, key="s", prev_tokens=5000)
    assert m.held(c.engine, m.resolve(again)) == 5000
    flood = TurnInfo(prompt_tokens=50_000)
    for i in range(1, 10):  # 450k tokens sent to the same engine since
        m.admitted(i, replace(c, reason=RouteReason.LEAST_COST, held_tokens=0), flood)
        m.finished(i)
    assert m.held(c.engine, m.resolve(again)) == 0
