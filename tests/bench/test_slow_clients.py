"""bench.hostile.slow_clients at a tiny scale, with the cap below the attackers so that
every outcome appears: checked against what Redis holds and what the relay counted.

Starts its own cluster and relay process (stopped by pid); the attackers run in a child
process, as in the benchmark.
"""

from __future__ import annotations

import pytest

from bench.hostile.slow_clients import KINDS, Workload, markdown, run, verdict

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_viewers_get_every_stored_frame_and_attackers_meet_their_deadlines() -> None:
    wl = Workload(attackers=60, viewers=20, quiet_s=1.0, attack_s=4.0, head_timeout_s=1.0,
                  body_timeout_s=1.0, keepalive_timeout_s=1.0, max_per_address=40)  # fmt: skip
    r = await run(wl)
    assert verdict(r) == [], verdict(r)
    v, a, relay = r["viewers"], r["attackers"], r["relay"]
    assert v["frames_read"] == v["frames_stored"] > 0  # every frame the backlogs hold
    assert v["latency_ms"]["attack"]["n"] > 0
    assert set(a["kinds"]) == set(KINDS)
    assert all(k["admitted"] > 0 for k in a["kinds"].values())
    assert a["refused_429"] > 0  # 60 connections against a cap of 40
    guard = relay["http_guard"]
    # what the attackers saw is what the relay counted (the viewers' streams are not)
    assert guard["too_many_connections"] == a["refused_429"]
    admitted = {k: s["admitted"] for k, s in a["kinds"].items()}
    assert guard["idle_timeout"] == admitted["idle"]
    assert guard["body_timeout"] == admitted["body_trickle"]
    assert (
        guard["head_timeout"]
        == admitted["silent"] + admitted["head_trickle"] + admitted["second_head"]
    )
    assert relay["fds"]["after"] <= relay["fds"]["before"] + 5
    assert "closed past its deadline" in markdown(r)
