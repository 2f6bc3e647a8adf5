"""Property tests of the router core (hypothesis): capacity, stability, minimal movement,
leases released exactly once on every path."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.routing.lease import AllEnginesFull, EngineSpec, Lease, LeaseState
from worker.routing.policy import SPILL_POLICIES
from worker.routing.router import Router
from worker.routing.wait import route_wait

KEYS = [f"session-{i}" for i in range(2000)]


def _specs(caps: list[int]) -> list[EngineSpec]:
    return [EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=c) for i, c in enumerate(caps)]


@settings(max_examples=150, deadline=None)
@given(
    caps=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    eps=st.sampled_from([0.0, 0.25, 1.0, 100.0]),
    spill=st.sampled_from(SPILL_POLICIES),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 10_000)), max_size=120),
)
def test_no_engine_ever_exceeds_its_cap_or_the_bounded_load_rule(
    caps: list[int], eps: float, spill: str, ops: list[tuple[bool, int]]
) -> None:
    r = Router(_specs(caps), vnodes=20, eps=eps, spill=spill)
    held: list[Lease] = []
    for is_route, n in ops:
        if is_route or not held:
            refused: AllEnginesFull | None = None
            try:
                held.append(r.route(f"k{n}"))
            except AllEnginesFull as full:
                refused = full
            if refused is not None:
                assert refused.retry_after_s > 0
                # refused only when nothing could take it: every engine at its cap or
                # at the bounded-load limit for one more request
                total1 = sum(r.in_flight().values()) + 1
                for eid, n_in in r.in_flight().items():
                    limit = math.ceil((1 + eps) * total1 / len(caps))
                    assert n_in >= min(caps[int(eid[1:])], limit)
        else:
            held.pop(n % len(held)).release()
        for eid, n_in in r.in_flight().items():
            assert 0 <= n_in <= caps[int(eid[1:])]
        assert sum(r.in_flight().values()) == len(held)
    for lease in held:
        lease.release()
    assert set(r.in_flight().values()) == {0}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), seed=st.integers(0, 1000))
def test_a_key_keeps_its_engine_while_loads_are_low(n: int, seed: int) -> None:
    r = Router(_specs([1000] * n), vnodes=40)
    keys = KEYS[seed : seed + 200]
    first = {k: r.preferred(k) for k in keys}
    for k in keys:  # light load: each routed (and held) once
        lease = r.route(k)
        assert lease.engine.id == first[k]
        assert not lease.spilled
        lease.release()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 12))
def test_adding_an_engine_moves_about_one_in_n_plus_one_keys_all_to_it(n: int) -> None:
    r = Router(_specs([10] * n), vnodes=160)
    before = {k: r.preferred(k) for k in KEYS}
    r.add_engine(EngineSpec(id="new", url="http://new", cap=10))
    after = {k: r.preferred(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)
    share = len(moved) / len(KEYS)
    assert abs(share - 1 / (n + 1)) < 0.5 / (n + 1)  # within half the expected share


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 12), victim=st.integers(0, 11))
def test_removing_an_engine_moves_only_its_keys(n: int, victim: int) -> None:
    r = Router(_specs([10] * n), vnodes=160)
    gone = f"e{victim % n}"
    before = {k: r.preferred(k) for k in KEYS}
    r.remove_engine(gone)
    after = {k: r.preferred(k) for k in KEYS}
    assert all(after[k] == before[k] for k in KEYS if before[k] != gone)
    assert all(after[k] != gone for k in KEYS)


@pytest.mark.parametrize("path", ["done", "error", "cancel", "timeout"])
async def test_a_lease_is_released_exactly_once_on_every_path(path: str) -> None:
    r = Router(_specs([1]), eps=100.0)
    held = asyncio.Event()

    async def use() -> None:
        with await route_wait(r, "k", deadline_s=1.0) as lease:
            assert lease.state is LeaseState.HELD
            held.set()
            if path == "error":
                raise RuntimeError("engine error")
            if path in ("cancel", "timeout"):
                await asyncio.Event().wait()  # until it is cancelled
            assert lease.release() is True  # done: released by hand ...
            assert lease.release() is False  # ... a second release is a counted no-op
            # ... and the with block does not release it a third time

    task = asyncio.create_task(use())
    await held.wait()
    if path == "cancel":
        task.cancel()
    if path == "timeout":  # a deadline that has passed: wait_for cancels the task at once
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 0)
    else:
        outcome = await asyncio.gather(task, return_exceptions=True)
        assert path != "error" or isinstance(outcome[0], RuntimeError)
    assert r.in_flight() == {"e0": 0}
    counters = r.snapshot()["counters"]
    assert counters["double_releases"] == (1 if path == "done" else 0)
    with r.route("k") as again:  # the slot is really free
        assert again.engine.id == "e0"
