"""The load test's own counting (pure), then a small run end to end on a stack of its own."""

from __future__ import annotations

import pytest

from bench.loadtest import LoadConfig, run_loadtest
from bench.viewer import OffsetTally
from worker.stack import StackSpec


def test_a_missing_tail_is_lost_not_silently_ignored() -> None:
    t = OffsetTally()
    for off in (1, 2, 4):
        t.feed(off)
    assert t.lost == 1  # the hole at 3
    assert t.settle(6) == 2  # 5 and 6 never arrived: the session went on to 6
    assert t.lost == 3
    assert t.settle(6) == 0  # idempotent


def test_a_reported_gap_is_not_lost() -> None:
    t = OffsetTally()
    t.feed(1)
    t.gap(2, 5, 5)  # the server said 2..5 are gone
    t.feed(6)
    assert (t.lost, t.gaps_reported) == (0, 1)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_small_load_run_counts_every_frame_and_ends_clean() -> None:
    cfg = LoadConfig(
        duration_s=6.0, viewers=24, screens_per_session=4, turns_per_s=2.0, max_tokens=20,
        progress=False, max_turns=10,
    )  # fmt: skip
    r = await run_loadtest(cfg, StackSpec(relays=2, workers=2, engines=2, abuse_limits=False))
    assert r["connected_at_start"] == 24
    assert 0 < r["turns"] <= 10
    assert (r["lost"], r["duplicated"], r["out_of_order"], r["errors"]) == (0, 0, 0, 0), r
    assert r["viewers_behind"] == 0, r
    assert (r["leases_held_end"], r["subscriptions_end"]) == (0, 0), r
    assert r["tokens_per_s"] >= r["token_frames_per_s"] > 0  # frames carry >= 1 token
    assert r["ttft_p50_ms"] > 0
    assert r["relay_cpu_s"] is not None  # our own stack: measured, not assumed idle
    assert r["relay_cpu_s"] > 0
