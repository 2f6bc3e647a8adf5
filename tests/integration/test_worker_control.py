"""Presence grace rule, engine liveness rule and engine heartbeats in Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.server import EngineConfig, start_engine
from relay.producer.presence import PresenceTracker
from relay.protocol.keys import engine_key
from worker.routing.control import (
    ControlPlane,
    EngineAnnouncer,
    ProbeState,
    parse_engine_arg,
    read_announced,
)
from worker.routing.lease import EngineSpec
from worker.routing.router import Router


def test_grace_timer_starts_at_turn_start():
    t = PresenceTracker(grace_s=10.0, started=100.0)
    assert t.observe(105.0, 0) is False
    assert t.observe(109.9, 0) is False
    assert t.observe(110.0, 0) is True


def test_a_watcher_resets_the_grace_timer():
    t = PresenceTracker(grace_s=10.0, started=0.0)
    assert t.observe(8.0, 1) is False
    assert t.observe(17.0, 0) is False
    assert t.unwatched_for(17.0) == pytest.approx(9.0)
    assert t.observe(18.0, 0) is True
    assert t.ever_watched


def test_probe_state_needs_consecutive_failures():
    p = ProbeState(fail_after=2)
    assert p.alive
    assert p.record(False) is False
    assert p.record(True) is False
    assert p.record(False) is False
    assert p.record(False) is True
    assert not p.alive
    assert p.record(True) is True
    assert p.alive


def test_engine_args():
    assert parse_engine_arg("http://10.0.0.5:8000", 4) == EngineSpec(
        id="10.0.0.5:8000", url="http://10.0.0.5:8000", cap=4
    )
    spec = parse_engine_arg("gpu-a=http://gpu-a:8000/v1/", 16)
    assert (spec.id, spec.url, spec.cap) == ("gpu-a", "http://gpu-a:8000/v1", 16)
    assert parse_engine_arg("https://x.example", 1).id == "x.example:443"
    with pytest.raises(ValueError):
        parse_engine_arg("ftp://x", 1)
    with pytest.raises(ValueError):
        parse_engine_arg("a{b}=http://x:1", 1)
    assert engine_key("gpu-a") == "tr:engines:{gpu-a}"


@pytest.mark.integration
async def test_heartbeats_announce_and_expire(redis: RedisCluster):
    spec = EngineSpec(id="hb-test-engine", url="http://127.0.0.1:1", cap=3)
    ann = EngineAnnouncer(redis, spec, ttl_s=0.6)
    await ann.start()
    try:
        assert spec in await read_announced(redis, 0.6)
    finally:
        await ann.stop(withdraw=False)
    await asyncio.sleep(0.8)
    assert spec not in await read_announced(redis, 0.6)  # expired: not alive
    ann2 = EngineAnnouncer(redis, spec, ttl_s=5)
    await ann2.start()
    await ann2.stop()  # withdraw deletes at once
    assert spec not in await read_announced(redis, 5)


@pytest.mark.integration
async def test_control_plane_follows_probes_and_heartbeats(redis: RedisCluster):
    eng = await start_engine(EngineConfig(port=0, engine_id="cp-a"))
    other = await start_engine(EngineConfig(port=0, engine_id="cp-b"))
    static = EngineSpec(id="cp-a", url=eng.url, cap=2)
    announced = EngineSpec(id="cp-b", url=other.url, cap=5)
    router = Router([static])
    down: list[str] = []
    ann = EngineAnnouncer(redis, announced, ttl_s=3)
    async with aiohttp.ClientSession() as http:
        cp = ControlPlane(
            router,
            http,
            [static],
            redis=redis,
            discover=True,
            probe_timeout_s=0.5,
            on_engine_down=lambda eid, why: down.append(eid),
        )
        try:
            await ann.start()
            alive = await cp.tick()
            assert {s.id for s in alive} == {"cp-a", "cp-b"}
            assert {s.id for s in router.engines()} == {"cp-a", "cp-b"}
            await eng.stop()
            await cp.tick()
            assert "cp-a" in {s.id for s in router.engines()}  # one failure is not death
            await cp.tick()
            assert {s.id for s in router.engines()} == {"cp-b"}
            assert down == ["cp-a"]
            await ann.stop()
            await cp.tick()
            assert router.engines() == []
            assert down == ["cp-a", "cp-b"]
        finally:
            await other.stop()
            await ann.stop()


@pytest.mark.integration
async def test_engine_cli_announces_itself_and_withdraws_on_sigterm(
    cluster, redis: RedisCluster, tmp_path: Path
):
    import sys

    from devstack.procs import Proc, free_port

    port = free_port()
    argv = [sys.executable, "-m", "devstack", "engine", "--port", str(port)]
    argv += ["--id", "announced-1", "--redis", cluster.url, "--cap", "5"]
    proc = Proc.start(argv, log=None, err_log=tmp_path / "engine.err", name="engine")
    try:
        want = EngineSpec(id="announced-1", url=f"http://127.0.0.1:{port}", cap=5)
        async with asyncio.timeout(30):
            while want not in await read_announced(redis, 3.0):
                assert proc.alive, proc.output(stderr=True)
                await asyncio.sleep(0.1)
    finally:
        assert await proc.stop(grace_s=30) == 0  # SIGTERM by pid
    assert want not in await read_announced(redis, 3.0)  # withdrawn, not left to expire
