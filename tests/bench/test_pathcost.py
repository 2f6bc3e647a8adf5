"""Smoke test of ``bench.peers.pathcost``: a tiny configuration of every phase (one reader
per session, a fan-out, a resume storm) for every system it has, on the suite's cluster.
It checks the JSON's shape, that each participant's share of a system's CPU per token adds
up to the whole, that tokenrelay lost and duplicated nothing against its backlog in Redis
(the storm included), and that an absent peer is named; it checks no speed. Socket.IO is
left out (named missing) where node/npm cannot install it, Centrifugo where Go cannot
build it (the first run on a machine builds it: minutes).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench.peers.pathcost import Config, add_arguments, config_from_args, phases, report, run
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Config(
    sessions=20,
    rates=(200,),
    fan_sessions=5,
    fan_viewers=3,
    fan_rate=100,
    storm_sessions=20,
    storm_rate=200,
    llm_rates=(60,),
    llm_sessions=30,
    llm_fan_sessions=30,
    llm_fan_viewers=2,
    seconds=2.0,
    warm_s=0.5,
    repeats=1,
    # the LLM-rate peers have their own test below (Centrifugo needs a Go build)
    systems=("tokenrelay", "socketio", "resumable-stream", "tokenrelay-sse", "bare"),
)


@pytest.mark.timeout(420)
async def test_tiny_run_adds_up_and_tokenrelay_loses_nothing(cluster: ClusterInfo) -> None:
    res = json.loads(json.dumps(await run(TINY, cluster.url)))  # what --json writes
    assert set(res["phases"]) == {"20x1_200", "5x3_100", "storm_20x1_200", "llm60_30x1",
                                  "llm60_30x2", "llm60_storm_30x1"}  # fmt: skip
    present = set(res["guarantees"])
    assert {"tokenrelay", "tokenrelay-sse", "bare"} <= present
    assert present | set(res["missing"]) == set(TINY.systems)
    for name, by_sys in res["results"].items():
        assert "tokenrelay" in by_sys, name
        for sysname, r in by_sys.items():
            us = r["us_per_token"]
            parts = [us[k] for k in ("producer", "redis", "server") if k in us]
            assert all(v >= 0 for v in parts), (name, sysname, us)
            assert us["whole"] > 0, (name, sysname, us)
            if sysname != "resumable-stream":  # its server (the resumers) is idle without any
                assert all(v > 0 for v in parts), (name, sysname, us)
            assert math.isclose(sum(parts), us["whole"], abs_tol=0.02), (name, sysname, us)
            assert math.isclose(sum(r["shares"].values()), 1.0, abs_tol=0.01)
            for rnd in r["rounds"]:
                assert rnd["delivered"] > 0
                assert rnd["published"] > 0
                assert set(rnd["cpu_s"]) <= {"producer", "redis", "server"}
            assert math.isfinite(r["p50_ms"])
            assert math.isfinite(r["p99_ms"])
            if sysname.startswith("tokenrelay"):
                assert r["lost"] == 0, (name, sysname, r)
                assert r["duplicated"] == 0, (name, sysname, r)
                assert r["expected"] == r["published"] * res["phases"][name]["viewers"]
                assert r["delivered"] == r["expected"]
                assert all(x["notes"]["reader_errors"] == 0 for x in r["rounds"])
                # Redis's time by command over the window: the publish script is in it
                cmds = {(c["role"], c["command"]) for c in r["redis_commands"]}
                assert ("masters", "evalsha") in cmds, (name, sysname, cmds)
                assert all(c["us_per_token"] >= 0 for c in r["redis_commands"])
                # the turns were opened before the window, and counted per turn apart
                assert all(float(x["notes"]["open_redis_us_per_turn"]) > 0 for x in r["rounds"])
    storm = res["results"]["storm_20x1_200"]["tokenrelay"]["rounds"][0]["notes"]
    assert storm["storm_readers"] == 20
    assert {a["aim"] for a in res["aims"]} >= {"relay CPU/frame vs bare relay"}
    if "socketio" in present:
        assert any(a["aim"] == "whole CPU/token vs socketio" for a in res["aims"])
    assert res["server_log_tracebacks"] == 0
    assert "| phase | system |" in report(res)
    assert "busiest commands" in report(res)


def test_phases_picks_the_named_ones_and_refuses_an_unknown_one() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = config_from_args(ap.parse_args(["--phases", "storm_1000x1_2000,1000x1_5000"]))
    assert [p.name for p in phases(cfg)] == ["1000x1_5000", "storm_1000x1_2000"]
    assert len(phases(Config())) == 10
    with pytest.raises(SystemExit, match="unknown phase 'storm'"):
        config_from_args(ap.parse_args(["--phases", "storm"]))


LLM_PEERS = Config(
    llm_rates=(60,),
    llm_sessions=30,
    llm_fan_sessions=30,
    llm_fan_viewers=2,
    seconds=2.0,
    warm_s=0.5,
    repeats=1,
    systems=("tokenrelay", "centrifugo", "socketio-streams"),
    only=("llm60_30x1", "llm60_storm_30x1"),
)


@pytest.mark.timeout(300)
async def test_llm_phases_beside_the_peers_that_keep_what_they_send(cluster: ClusterInfo) -> None:
    """Centrifugo (when built here: this test builds nothing) and Socket.IO with the
    streams adapter (when npm can install it) in the LLM-rate phases: their Redis work is
    what their guarantees say (Centrifugo's history in Redis streams, the streams
    adapter's XADD), tokenrelay loses nothing in the storm, and Centrifugo's screens lose
    nothing against its history."""
    from bench.peers.centrifugo import ensure_centrifugo
    from bench.peers.node import node_missing

    if isinstance(built := ensure_centrifugo(build=False), str):
        pytest.skip(f"Centrifugo: {built}")
    if (why := node_missing("the Socket.IO side")) is not None:
        pytest.skip(why)
    res = json.loads(json.dumps(await run(LLM_PEERS, cluster.url)))
    assert not res["missing"], res["missing"]
    assert not res["failed_rounds"], res["failed_rounds"]
    steady, storm = res["results"]["llm60_30x1"], res["results"]["llm60_storm_30x1"]
    for by_sys in (steady, storm):
        assert set(by_sys) == {"tokenrelay", "centrifugo", "socketio-streams"}
        assert by_sys["tokenrelay"]["lost"] == 0
        assert by_sys["tokenrelay"]["duplicated"] == 0
        cmds = {c["command"] for c in by_sys["centrifugo"]["redis_commands"]}
        assert cmds & {"xadd", "evalsha", "fcall"}, cmds  # its history is in Redis
        assert "xadd" in {c["command"] for c in by_sys["socketio-streams"]["redis_commands"]}
    assert steady["centrifugo"]["lost"] == 0  # against its own history in Redis
    assert storm["tokenrelay"]["rounds"][0]["notes"]["storm_recovered"] == 30
    assert "| llm60_storm_30x1 | centrifugo |" in report(res)
