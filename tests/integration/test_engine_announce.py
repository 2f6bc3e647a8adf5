"""`python -m devstack engine --redis`: the announcement is a supervised loop. It keeps the
engine in the registry of a real Redis Cluster, reports itself in the engine's
/metrics, survives an unreachable Redis (the engine keeps serving, the loop counts its
failures and retries), and is withdrawn on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import Proc, log_line
from relay.protocol.keys import engine_key
from tests.support.cli import clean_env, devstack
from worker.routing.control import read_announced

pytestmark = pytest.mark.integration


async def _engine(tmp: Path, *argv: str) -> tuple[Proc, str]:
    proc = Proc.start(
        devstack("engine", "--port", "0", *argv), log=tmp / "engine.out",
        err_log=tmp / "engine.err", env=clean_env(), name="engine",
    )  # fmt: skip
    try:
        await proc.ready(log_line("\n"), timeout_s=30)
    except BaseException:
        await proc.stop()
        raise
    line = proc.output().splitlines()[0]
    assert "listening on" in line, line
    return proc, line.rsplit(" ", 1)[-1].strip()


async def _stop(proc: Proc) -> bytes:
    """SIGTERM by pid (the process this test started); its stderr; exit code 0."""
    code = await proc.stop(grace_s=30)
    err = proc.output(stderr=True)
    assert code == 0, err
    return err.encode()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{name}{{loop="engine-announce"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_the_engine_announces_itself_on_a_supervised_loop_and_withdraws(
    cluster: ClusterInfo, redis: RedisCluster, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    eid = f"ann-{secrets.token_hex(4)}"
    proc, url = await _engine(tmp_path, "--id", eid, "--redis", cluster.url,
                              "--announce-url", "http://127.0.0.1:1/", "--cap", "5")  # fmt: skip
    try:
        async with asyncio.timeout(15):
            while not [e for e in await read_announced(redis, 3.0) if e.id == eid]:
                await asyncio.sleep(0.2)
        (spec,) = [e for e in await read_announced(redis, 3.0) if e.id == eid]
        assert (spec.url, spec.cap) == ("http://127.0.0.1:1/", 5)
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert _metric(text, "tokenrelay_loop_healthy") == 1.0
        assert _metric(text, "tokenrelay_loop_failures_total") == 0.0
    finally:
        await _stop(proc)
    assert await redis.exists(engine_key(eid)) == 0  # withdrawn on a clean stop


async def test_an_unreachable_redis_does_not_stop_the_engine(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    proc, url = await _engine(tmp_path, "--redis", "redis://127.0.0.1:1",  # no Redis
                              "--announce-url", "http://127.0.0.1:2/")  # fmt: skip
    try:
        async with asyncio.timeout(20):
            while True:
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                if _metric(text, "tokenrelay_loop_failures_total") >= 2:
                    break  # failed, backed off, tried again
                await asyncio.sleep(0.2)
        async with http.get(url + "/health") as r:
            assert r.status == 200  # still serving
    finally:
        err = await _stop(proc)
    assert b"Traceback" not in err
    assert b"background loop engine-announce" in err
