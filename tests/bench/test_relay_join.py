"""``bench.relay.join`` small, on the suite's cluster: a compacted join of a finished
session is three frames per turn (and the running turn's four), the full join every
offset, both checked by the benchmark against the session's text and continuity."""

from __future__ import annotations

import pytest

from bench.relay.join import measure, table
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(120)
async def test_a_compacted_join_is_three_frames_per_finished_turn(cluster: ClusterInfo) -> None:
    res = await measure(cluster.url, turns=20, tokens=10, repeats=1, seed=3)
    rows = {(r["transport"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {("sse", "compact"), ("sse", "full"), ("ws", "compact"), ("ws", "full")}
    for transport in ("sse", "ws"):
        compact, full = rows[transport, "compact"], rows[transport, "full"]
        assert compact["frames"] == 3 * 20 + 4
        assert full["frames"] == res["session"]["offsets"] == 20 * 12 + 4
        assert compact["bytes"] < full["bytes"]
    assert "| sse | compact | 64 |" in table(res)
