"""Smoke test of ``bench.peers.socketio``: a tiny configuration of every phase (1 client
per session at a low rate, a fan-out, idle connections) for tokenrelay's relay and for
Socket.IO with the sharded Redis adapter, on the suite's cluster. It checks the shape of
the JSON the benchmark writes and that neither system lost a message at a rate both
carry; it checks no speed. Skipped with the reason where node/npm are missing or npm
cannot install Socket.IO (no access to the registry).
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench.peers.node import ensure_socketio
from bench.peers.socketio import Config, run
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FIGURES = ("offered_per_s", "delivered_per_s", "lost", "cpu_us_per_msg", "p50_ms", "p99_ms")

TINY = Config(
    sessions=20,
    rates=(200,),
    fan_sessions=5,
    fan_viewers=3,
    fan_deliveries=300,
    seconds=1.5,
    warm_s=0.5,
    repeats=1,
    idle=60,
    connect_window=20,
)


@pytest.mark.timeout(420)
async def test_tiny_run_has_every_figure_and_loses_nothing(cluster: ClusterInfo) -> None:
    modules = await asyncio.to_thread(ensure_socketio)
    if isinstance(modules, str):
        pytest.skip(modules)
    res = await run(TINY, cluster.url, modules)
    json.loads(json.dumps(res))  # what --json writes
    assert set(res["phases"]) == {"20x1_200", "5x3_300"}
    for name, viewers in (("20x1_200", 1), ("5x3_300", 3)):
        for kind in ("tokenrelay", "socketio"):
            r = res["phases"][name][kind]
            for k in FIGURES:
                assert isinstance(r[k], int | float), (name, kind, k)
                assert math.isfinite(r[k]), (name, kind, k)
            assert r["lost"] == 0, (name, kind, r)
            assert r["client_errors"] == 0, (name, kind, r)
            assert r["publish_errors"] == 0, (name, kind, r)
            assert r["sent"] > 0
            assert r["received"] == r["sent"] * viewers
            assert r["offered_per_s"] > 0
            assert r["delivered_per_s"] > 0
            assert r["cpu_us_per_msg"] > 0
            assert 0 < r["p50_ms"] <= r["p99_ms"]
            assert len(r["rounds"]) == TINY.repeats
    for kind in ("tokenrelay", "socketio"):
        idle = res["idle"][kind]
        assert idle["connections"] == TINY.idle
        assert idle["client_errors"] == 0
        assert idle["rss_after_kb"] > 0
        assert isinstance(idle["rss_kb_per_conn"], int | float)
    assert res["versions"]["socket.io"].startswith("4.8.")
    assert res["versions"]["@socket.io/redis-adapter"].startswith("8.3.")
    assert res["server_log_tracebacks"] == 0
