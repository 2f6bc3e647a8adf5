"""Smoke test of ``bench.relay.micro``: a tiny run (on the in-memory broker) writes every
frame it feeds to its session's socket once, profiled run included."""

from __future__ import annotations

import pytest

from bench.relay.micro import measure


@pytest.mark.timeout(120)
async def test_every_fed_frame_is_written_once() -> None:
    res = await measure(sessions=20, frames=2_000, per_chunk=2, repeats=2, profile=True, seed=1)
    # 2 frames per chunk go to 2 different sessions: one write per frame, 3 runs
    assert res["socket_writes"] == 2_000 * 3
    assert res["hub_us_per_frame"] > 0
    assert len(res["runs_us_per_frame"]) == 2
    assert "_on_message" in res["profile"]
