"""A turn whose engine refuses the connection moves to the next engine for its key."""

from __future__ import annotations

from worker.routing.lease import EngineSpec
from worker.routing.router import Router


def test_route_avoiding_an_engine_spills_to_the_next_one() -> None:
    r = Router([EngineSpec(id=f"e{i}", url=f"http://e{i}", cap=8) for i in range(3)])
    first = r.route("some prompt prefix")
    other = r.route("some prompt prefix", avoid=first.engine.id)
    assert other.engine.id != first.engine.id
    assert other.spilled
    assert other.preferred == first.engine.id
    first.release()
    other.release()
    assert r.in_flight() == {"e0": 0, "e1": 0, "e2": 0}
