"""The Router's cost_aware policy: the product side of worker/routing/cost.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.routing.cost import CostModel, TurnInfo, turn_info
from worker.routing.lease import EngineSpec, Lease, LeaseState, LoadView
from worker.routing.policy import RouteReason
from worker.routing.router import Router


def _router(n: int = 3, cap: int = 4) -> Router:
    specs = [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=cap) for i in range(n)]
    return Router(specs, policy="cost_aware")


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
)
def test_caps_hold_and_every_lease_is_released_exactly_once(
    ops: list[tuple[int, int, bool]], cap: int, drained: str | None
) -> None:
    r = _router(cap=cap)
    if drained:
        r.drain_engine(drained)
    r.apply_load_view(LoadView(others={"e2": 3}, allowance={"e2": max(1, cap - 1)}))
    held: list[Lease] = []
    for conv, tokens, release in ops:
        lease = r.try_route(f"c{conv}", turn=TurnInfo(prompt_tokens=tokens, key=f"c{conv}"))
        if lease is not None:
            assert lease.engine.id != drained
            held.append(lease)
            lease.first_token()
        for eid, n in r.in_flight().items():
            assert n <= (max(1, cap - 1) if eid == "e2" else cap)
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
    r = _router(n=2, cap=1)
    a = r.route("k", turn=TurnInfo(prompt_tokens=100, key="k"))
    b = r.route("k", avoid=a.engine.id, turn=TurnInfo(prompt_tokens=100, key="k"))
    assert b.engine.id != a.engine.id
    assert r.try_route("k", turn=TurnInfo(prompt_tokens=100, key="k")) is None  # both full


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
        m.admitted(i, type(c)(c.engine, RouteReason.LEAST_COST, 0.0, 0), flood)
        m.finished(i)
    assert m.held(c.engine, m.resolve(again)) == 0
