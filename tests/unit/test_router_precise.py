"""Pure tests of the precise routing policy: the cost model reads the block index for the
engines that publish events and estimates the others."""

from __future__ import annotations

from worker.routing.blockindex import BlockIndex
from worker.routing.cost import CostModel, TurnInfo
from worker.routing.kvwire import BlockStored, KVEventBatch
from worker.routing.lease import EngineSpec
from worker.routing.policy import RouteReason
from worker.routing.router import Router
from worker.routing.tokens import block_keys

BS = 16
PREFIX = list(range(4096))  # a 4k-token shared prefix


def _index(live: dict[str, int]) -> BlockIndex:
    """Engines that published events; each holds that many tokens of PREFIX."""
    ix = BlockIndex(BS)
    for name, tokens in live.items():
        ix.add_engine(name)
        ix.sequence(name, 0)
        n = tokens // BS
        ev = BlockStored(list(range(1, n + 1)), None, PREFIX[: n * BS], BS, None, "GPU")
        ix.apply(name, KVEventBatch(0.0, [ev] if n else []), 0.0)
    return ix


def _turn(key: str = "k", **kw: object) -> TurnInfo:
    prompt = [*PREFIX, *range(10_000, 10_200)]
    return TurnInfo(prompt_tokens=len(prompt), key=key, blocks=tuple(block_keys(prompt, BS)), **kw)  # type: ignore[arg-type]


def test_precise_goes_where_the_index_says_the_prefix_is() -> None:
    ix = _index({"a": 0, "b": 0, "c": 4096})
    m = CostModel(["a", "b", "c"], index=ix)
    choice = m.choose(_turn())
    assert choice.engine == "c"
    assert choice.held_tokens == 4096
    assert choice.reason is RouteReason.PREFERRED
    # the estimate, without the index, knows nothing of c's cache
    assert CostModel(["a", "b", "c"]).choose(_turn()).held_tokens == 0


def test_the_index_overrides_a_stale_guess() -> None:
    # the session's previous engine was a, by the meta; a evicted it, b holds it
    ix = _index({"a": 0, "b": 4096})
    m = CostModel(["a", "b"], index=ix)
    turn = _turn(prev_engine="a", prev_tokens=4096, prev_mark=0)
    assert m.choose(turn).engine == "b"
    assert CostModel(["a", "b"]).choose(turn).engine == "a"


def test_engines_without_events_are_estimated() -> None:
    ix = _index({"a": 0})  # b publishes nothing: not in the index
    m = CostModel(["a", "b"], index=ix)
    turn = _turn(prev_engine="b", prev_tokens=4096, prev_mark=0)
    choice = m.choose(turn)
    assert choice.engine == "b"
    assert choice.held_tokens == 4096
    assert m.costs(turn, {})["a"][1] == 0  # by the index


def test_a_shared_prefix_in_flight_counts_before_its_blocks_are_published() -> None:
    ix = _index({"a": 0, "b": 0})
    m = CostModel(["a", "b"], index=ix)
    first = _turn("u1", shared_key="sys", shared_tokens=4096)
    c1 = m.choose(first)
    m.admitted(1, c1, first)  # prefill under way: no BlockStored yet
    costs = m.costs(_turn("u2", shared_key="sys", shared_tokens=4096), {})
    other = "b" if c1.engine == "a" else "a"
    assert costs[c1.engine][1] == 4096
    assert costs[other][1] == 0


def test_the_router_routes_precisely_and_turns_without_blocks_fall_back() -> None:
    specs = [EngineSpec(id=n, url=f"http://{n}", cap=4) for n in ("a", "b", "c")]
    ix = _index({"a": 0, "b": 4096, "c": 0})
    r = Router(specs, policy="precise", index=ix)
    assert r.index is ix
    lease = r.route("k", turn=_turn())
    assert lease.engine.id == "b"
    lease.release()
    plain = Router(specs, policy="cost_aware", index=ix)
    assert plain.index is None  # only precise reads the index
    assert r.route("k2", turn=TurnInfo(prompt_tokens=100)).engine.id in ("a", "b", "c")
