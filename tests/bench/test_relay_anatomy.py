"""The relay's anatomy holds its shape (``bench.relay.anatomy`` on the suite's cluster): a
live frame's path enters each module once and passes at most five, and an idle
connection is at most three objects of the relay's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.relay.anatomy import count_idle, trace_walk
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration]

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def _documented_walk() -> list[str]:
    """The modules of docs/ARCHITECTURE.md's walk (the code block of "A frame's walk")."""
    text = ARCHITECTURE.read_text().split("### A frame's walk", 1)[1]
    return text.split("```", 2)[1].strip().split(" -> ")


@pytest.mark.timeout(120)
async def test_a_live_frame_enters_each_module_once(cluster: ClusterInfo) -> None:
    walks = await trace_walk(cluster.url)
    for transport, w in walks.items():
        assert w["path"][0].endswith("nodeconn.py"), (transport, w["trace"])
        assert w["path"][-1] == "relay/edge/conn/base.py", (transport, w["trace"])
        assert w["revisited"] == [], (transport, w["trace"])
        assert w["modules"] <= 5, (transport, w["trace"])
        assert w["path"] == _documented_walk(), "docs/ARCHITECTURE.md shows another walk"


@pytest.mark.timeout(120)
async def test_an_idle_connection_holds_at_most_three_objects_of_the_relay(
    cluster: ClusterInfo,
) -> None:
    idle = await count_idle(cluster.url, 40)
    own = idle["sse_one_session"]["project"]  # the connection's own, not its session's
    assert sum(own.values()) <= 3, own
    assert own.get("relay.edge.conn.sse.SseConn") == 1, own
    for name in ("sse", "ws"):  # each on its own session: plus its channel and resume
        assert sum(idle[name]["project"].values()) <= 5, idle[name]
