"""Smoke test of ``bench.relay.throughput``: a tiny configuration of every phase on the
suite's cluster (raw redis-py reader, relay with 1 and with 3 viewers per session,
paced latency, idle connections, the bare relay beside it), checked for consistency,
not for speed: every figure present and positive, every frame sent delivered to every
viewer, nothing lost, every idle connection held by the relay, no traceback in the
relay's logs.
"""

from __future__ import annotations

import json

import pytest

from bench.relay.throughput import Config, run
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = (
    "raw_msgs_per_s",
    "relay_frames_per_s",
    "ratio",
    "fanout10_writes_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "rss_kb_per_idle_conn",
    "raw_hiredis_msgs_per_s",
    "ratio_hiredis",
    "relay_cpu_us_per_frame",
    "latency_5k_p50_ms",
    "latency_5k_p99_ms",
    "rss_kb_per_idle_ws_conn",
    "replay_frames_per_s",
    "replay_rss_peak_mb",
    "bare_frames_per_s",
    "bare_ratio_hiredis",
    "bare_latency_5k_p50_ms",
    "bare_latency_5k_p99_ms",
)

TINY = Config(
    sessions=30,
    frames=20,
    fanout=3,
    batch=10,
    lat_sessions=20,
    lat_rate=20.0,
    lat_seconds=1.0,
    idle=300,
    connect_window=50,
    repeats=2,
    replay_frames=2_000,
    replay_clients=5,
)


@pytest.mark.timeout(180)
async def test_tiny_run_delivers_every_frame(cluster: ClusterInfo) -> None:
    res = await run(TINY, cluster.url)
    json.dumps(res)  # what --json writes
    for k in KEYS:
        assert isinstance(res[k], int | float), k
        assert res[k] > 0, (k, res[k])
    ph = res["phases"]
    raw, relay1, fan, lat = ph["raw"], ph["relay1"], ph["fanout"], ph["latency"]

    assert raw["sent"] == TINY.sessions * TINY.frames
    assert raw["received"] == raw["sent"]

    assert relay1["clients"] == TINY.sessions
    assert relay1["sent"] == TINY.sessions * TINY.frames
    assert relay1["received"] == relay1["expected_writes"] == relay1["sent"]

    assert fan["sessions"] == TINY.sessions // TINY.fanout
    assert fan["clients"] == fan["sessions"] * TINY.fanout
    assert fan["sent"] == fan["sessions"] * TINY.frames
    assert fan["received"] == fan["expected_writes"] == fan["sent"] * TINY.fanout

    for phase in (raw, relay1, fan):
        assert phase["lost_all_rounds"] == 0
        assert len(phase["rounds_per_s"]) == TINY.repeats
        assert all(r > 0 for r in phase["rounds_per_s"])
    for phase in (relay1, fan, lat):
        assert phase["lost"] == 0
        assert phase["client_errors"] == 0
    for phase in (relay1, fan):  # a conflated event carries several tokens
        assert 0 < phase["events"] <= phase["received"]
    assert lat["sent"] > 0
    assert lat["publish_errors"] == 0
    assert lat["received"] == lat["sent"]
    assert lat["samples"] > 0
    assert res["latency_p50_ms"] <= res["latency_p99_ms"]

    assert res["ratio"] == pytest.approx(
        res["relay_frames_per_s"] / res["raw_msgs_per_s"], rel=0.01
    )
    for name in ("idle", "idle_one_session"):
        idle = ph[name]
        assert idle["connections"] == TINY.idle
        assert idle["connections_seen_by_relay"] == TINY.idle + 1  # + the warm-up stream
        assert idle["rss_after_kb"] > idle["rss_before_kb"]
    assert ph["idle"]["sessions"] == TINY.idle
    assert ph["idle_one_session"]["sessions"] == 1
    assert res["relay_log_tracebacks"] == 0
    hi, l5, ws, rp = ph["raw_hiredis"], ph["latency_5k"], ph["idle_ws"], ph["replay"]
    assert hi["received"] == hi["sent"] == TINY.sessions * TINY.frames
    assert l5["received"] == l5["sent"] > 0
    assert l5["relay_loop_lag"]["samples"] > 0  # the relay samples its loop
    assert ws["connections"] == TINY.idle
    assert rp["complete"] == TINY.replay_clients  # every replay reached the last offset
    assert rp["delivered"] == TINY.replay_frames * TINY.replay_clients
    # the bare relay (the floor beside the relay) got every frame to every client too
    b5, b1 = ph["bare_5k"], ph["bare_relay1"]
    # CPU times come from /proc in 10 ms ticks: over a tiny run the bare relay (no
    # background work at all) may not be charged a single one
    assert res["bare_cpu_us_per_frame"] >= 0
    if res["bare_cpu_us_per_frame"] > 0:
        assert res["relay_cpu_vs_bare"] == pytest.approx(
            res["relay_cpu_us_per_frame"] / res["bare_cpu_us_per_frame"], abs=0.01
        )
    else:
        assert "relay_cpu_vs_bare" not in res
    assert b5["received"] == b5["sent"] > 0
    assert b5["lost"] == b5["client_errors"] == 0
    assert b1["received"] == b1["expected_writes"] == TINY.sessions * TINY.frames
    assert b1["lost"] == b1["client_errors"] == 0
