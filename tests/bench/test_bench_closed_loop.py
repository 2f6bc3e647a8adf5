"""bench.load.closed_loop at a tiny scale: every stamped token reaches both paths.

Starts its own cluster, stamp engine, worker and relay processes (stopped by pid) and
checks the record: both paths saw every token the engine sent, with latencies.
"""

from __future__ import annotations

import pytest

from bench.load.closed_loop import Workload, markdown, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_both_paths_see_every_token_and_report_latency() -> None:
    wl = Workload(sessions=3, turns=1, tokens=12, tokens_per_s=100.0)
    r = await run(wl)
    for name in ("closed_loop", "relay"):
        p = r["paths"][name]
        assert p["tokens"] == 3 * 12, name
        assert p["missed"] == 0, name
        assert p["p99_ms"] >= p["p50_ms"] > 0, name
    assert r["relay_adds_p50_ms"] is not None
    assert "closed_loop" in markdown(r)
