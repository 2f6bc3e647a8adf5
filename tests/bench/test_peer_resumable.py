"""Smoke test of ``bench.peers.resumable``: a tiny configuration of every phase of
Vercel's resumable-stream (1 reader per stream, a fan-out through its per-listener
PUBLISH, a resume storm, its producer killed) on a single node and on a 3+3 cluster the
benchmark starts itself. It checks the JSON's shape, that nothing was lost or duplicated
where the library keeps its promise, and what its readers get after a producer death; it
checks no speed. Skipped with the reason where node/npm are missing or npm cannot install
the pinned packages (no access to the registry).
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench.peers.resumable import Config
from bench.peers.resumable_run import run
from bench.peers.rsdriver import ensure_modules

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Config(
    sessions=10, rates=(100,), fan_sessions=3, fan_viewers=3, fan_rate=60, storm_rate=100,
    kill_sessions=3, kill_rate=60, seconds=1.5, repeats=1,
)  # fmt: skip
PHASES = {"10x1_100": 1, "3x3_60": 3, "storm_10x1_100": 1}


@pytest.mark.timeout(420)
async def test_tiny_run_has_every_figure_and_keeps_the_librarys_promises() -> None:
    modules = await asyncio.to_thread(ensure_modules)
    if isinstance(modules, str):
        pytest.skip(modules)
    res = await run(TINY)
    json.loads(json.dumps(res))  # what --json writes
    assert set(res["guarantees"]) == {"resumable-stream", "tokenrelay"}
    assert set(res["targets"]) == {"node", "cluster"}
    for mode, t in res["targets"].items():
        assert set(t["phases"]) == set(PHASES)
        for name, r in t["phases"].items():
            assert r["published"] > 0, (mode, name)
            assert r["duplicated"] == 0, (mode, name, r)
            assert r["delivered"] == r["published"] * PHASES[name] - r["lost"], (mode, name, r)
            if mode == "node":
                assert r["lost"] == 0, (mode, name, r)
            else:
                # node-redis sends each PUBLISH to the next node round-robin, so on the
                # cluster a resumed reader's chunks can arrive out of order, and its DONE
                # can overtake its last chunks (the library closes the stream at DONE):
                # the library's own loss, always at the end; never a hole mid-stream
                assert r["lost"] == r["notes"]["lost_at_the_end"], (mode, name, r)
            us = r["us_per_delivered"]
            assert set(us) == {"producer", "redis", "server", "whole"}
            assert all(math.isfinite(v) and v >= 0 for v in us.values())
            assert us["producer"] > 0
            assert r["notes"]["after_end"] == "null (Stream is already done)"
        assert t["phases"]["10x1_100"]["us_per_delivered"]["server"] == 0
        assert t["phases"]["3x3_60"]["us_per_delivered"]["server"] > 0
        killed = t["producer_killed"]
        assert killed["viewers"] == 3
        assert killed["tokens_before_kill"] > 0
        assert killed["streams_ended"] == 0  # nothing tells them the producer is gone
        assert all(a != "a stream" for a in killed["fresh_resume_after_kill"])
    # tokenrelay beside it on the cluster, the same phases, counted against its backlog
    tr = res["targets"]["cluster"]["tokenrelay_phases"]
    assert set(tr) == set(PHASES)
    for name, r in tr.items():
        assert r["lost"] == 0, (name, r)
        assert r["delivered"] == r["published"] * PHASES[name], (name, r)
        assert r["us_per_delivered"]["whole"] > 0
    # tokenrelay's backlog outlives its producer
    assert res["targets"]["cluster"]["tokenrelay_killed"]["backlog_frames_after_kill"] > 0
    bus = res["targets"]["cluster"]["cluster_bus"]
    assert len(bus) == 2
    assert all(b["tokens"] > 0 for b in bus.values())
