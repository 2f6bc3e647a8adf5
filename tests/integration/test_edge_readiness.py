"""The relay's readiness: Redis unreachable at start, --fail-fast, failing background loops.

A relay process started while nothing listens at its Redis URL stays alive (``/healthz``
200), says why it is not ready (``/readyz`` 503 ``redis_unreachable``), refuses streams
with 503, keeps trying, and becomes ready once a cluster comes up on that port. With
``--fail-fast`` it exits 1 with one line naming the URL (password masked). A critical
background loop that keeps failing makes ``/readyz`` name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from devstack.cluster.launcher import ClusterInfo, LocalCluster, find_free_base_port
from devstack.procs import launched
from relay.broker.rediscluster.connect import connect
from relay.broker.rediscluster.publisher import Publisher
from relay.edge.config import RelayConfig
from relay.edge.http.app import SERVER, make_app, make_runner
from relay.edge.http.server import EdgeServer
from relay.protocol.keys import new_session_id
from tests.conftest import PrivateClusterFactory
from tests.support.cli import run_cli, tokenrelay

pytestmark = pytest.mark.integration

STEP = 30.0
PASSWORD = "hunter2-not-logged"


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url) as r:
        return r.status, await r.json()


@contextlib.asynccontextmanager
async def _relay_process(tmp_path: Path, *argv: str) -> AsyncIterator[tuple[str, Path]]:
    """A ``tokenrelay relay`` process on a free port; stopped by its pid on exit."""
    port = find_free_base_port(1)
    log = tmp_path / "relay.log"
    env = {**os.environ, "TOKENRELAY_INSECURE_NO_AUTH": "1"}
    env.pop("TOKENRELAY_SECRET", None)
    argv_ = tokenrelay("relay", "--port", str(port), "--relay-id", "late-edge", *argv)
    async with launched(argv_, log=log, env=env, name="late-edge", grace_s=15.0):
        yield f"http://127.0.0.1:{port}", log


async def _until(http: aiohttp.ClientSession, url: str, status: int) -> dict[str, Any]:
    async with asyncio.timeout(STEP):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                got, body = await _get(http, url)
                if got == status:
                    return body
            await asyncio.sleep(0.1)


@pytest.mark.timeout(180)
async def test_a_relay_started_without_redis_retries_and_becomes_ready_when_redis_comes_up(
    tmp_path: Path,
) -> None:
    base = find_free_base_port(3)  # where the cluster will come up, later
    url = f"redis://127.0.0.1:{base}"
    async with (
        _relay_process(tmp_path, "--redis", url) as (relay, log),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
    ):
        assert (await _until(http, relay + "/healthz", 200))["status"] == "alive"
        status, body = await _get(http, relay + "/readyz")
        assert status == 503, body
        assert body["status"] == "redis_unreachable"
        assert body["reasons"] == ["redis_unreachable"]
        assert body["reason"]
        sid = new_session_id()
        status, body = await _get(http, f"{relay}/v1/sessions/{sid}/events")
        assert (status, body["error"]) == (503, "unavailable"), body

        cluster = LocalCluster(masters=3, replicas=0, base_port=base)
        try:
            info = await cluster.start()
            ready = await _until(http, relay + "/readyz", 200)
            assert (ready["status"], ready["reasons"]) == ("ready", [])
            await _stream_one_turn(http, relay, info)
        finally:
            await cluster.stop()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert f"cannot connect to Redis at {url}" in text, text[-3000:]
    assert f"connected to Redis at {url}" in text, text[-3000:]


async def _stream_one_turn(http: aiohttp.ClientSession, relay: str, info: ClusterInfo) -> None:
    redis = connect(info.url)
    await redis.initialize()
    try:
        sid = new_session_id()
        gen = await Publisher(redis).open_generation(sid)
        await gen.token("late but here")
        await gen.done()
        url = f"{relay}/v1/sessions/{sid}/events"
        async with http.get(url, params={"last_event_id": "0"}) as r:
            assert r.status == 200, await r.text()
            async with asyncio.timeout(STEP):
                seen = b""
                while b"event: done" not in seen:
                    line = await r.content.readline()
                    assert line, seen
                    seen += line
        assert b"late but here" in seen
    finally:
        await redis.aclose()


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_fail_fast_exits_1_with_one_line_naming_the_masked_url(how: str) -> None:
    port = find_free_base_port(1)  # nothing listens there
    url = f"redis://default:{PASSWORD}@127.0.0.1:{port}"
    env = {**os.environ, "TOKENRELAY_INSECURE_NO_AUTH": "1"}
    env.pop("TOKENRELAY_SECRET", None)
    argv = ["relay", "--port", "0", "--redis", url]
    if how == "flag":
        argv.append("--fail-fast")
    else:
        env["TOKENRELAY_FAIL_FAST"] = "true"
    ran = await run_cli(tokenrelay(*argv), env=env, timeout_s=STEP, merge=True)
    text = ran.out
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert ran.code == 1, text
    assert lines[-1].startswith(
        f"error: cannot connect to Redis at redis://default:***@127.0.0.1:{port}: "
    )
    assert "Traceback" not in text, text
    assert PASSWORD not in text


@contextlib.asynccontextmanager
async def _in_process(cluster: ClusterInfo) -> AsyncIterator[tuple[EdgeServer, str]]:
    app = make_app(RelayConfig(redis_url=cluster.url, insecure_no_auth=True, relay_id="r-ready"))
    runner = make_runner(app, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield app[SERVER], f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_relay_loops_run_supervised_and_readyz_names_a_critical_one_that_keeps_failing(
    cluster: ClusterInfo,
) -> None:
    async with (
        _in_process(cluster) as (server, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
    ):
        loops = server.supervisor.loops
        assert {"subscriber", "presence", "reaper", "sse_heartbeats", "loop_lag"} <= set(loops)
        assert loops["subscriber"].critical
        assert loops["presence"].critical
        assert not loops["reaper"].critical
        assert await _get(http, base + "/readyz") == (
            200, {"status": "ready", "relay": "r-ready", "reasons": []}
        )  # fmt: skip

        async def broken() -> None:
            raise RuntimeError("a bug in a critical loop")

        server.supervisor.every("probe", 0.01, broken, critical=True)
        body = await _until(http, base + "/readyz", 503)
        assert (body["status"], body["reasons"]) == ("not_ready", ["probe_failing"])
        async with http.get(base + "/healthz") as r:
            assert r.status == 200
        async with http.get(base + "/metrics") as r:
            text = await r.text()
        assert 'tokenrelay_loop_healthy{loop="probe"} 0.0' in text
        assert 'tokenrelay_loop_healthy{loop="subscriber"} 1.0' in text


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_subscriber_that_cannot_subscribe_makes_the_relay_not_ready(
    private_cluster: PrivateClusterFactory,
) -> None:
    local = await private_cluster(masters=3, replicas=0)
    assert local.info is not None
    async with (
        _in_process(local.info) as (server, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        assert (await _get(http, base + "/readyz"))[0] == 200
        await local.stop()
        # a new session needs a subscription the subscriber cannot make: its loop fails
        # round after round until the watch gives up
        watch = asyncio.ensure_future(_get(http, f"{base}/v1/sessions/{new_session_id()}/events"))
        try:
            async with asyncio.timeout(STEP):
                while True:
                    status, body = await _get(http, base + "/readyz")
                    if "subscriber_failing" in body["reasons"]:
                        break
                    await asyncio.sleep(0.1)
            assert status == 503
            assert body["status"] == "redis_unreachable"  # the ping fails too: said first
            status, body = await watch
            assert (status, body["error"]) == (503, "unavailable")
        finally:
            watch.cancel()
        assert server.supervisor.loops["subscriber"].failures >= 3
