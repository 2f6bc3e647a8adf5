"""A worker whose Redis is unreachable at start: a real process keeps retrying in the
background (/healthz 200, /readyz 503 ``redis_unreachable``, turns 503) and becomes ready
once a cluster comes up on that port; with ``fail_fast`` it exits 1 with one line that
names the URL without its password."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from devstack.cluster.launcher import LocalCluster, find_free_base_port
from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from worker.cli import serve
from worker.config import WorkerConfig
from worker.routing.lease import EngineSpec

pytestmark = pytest.mark.integration


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    running = await start_engine(EngineConfig(port=0, engine_id="e-start"))
    try:
        yield running
    finally:
        await running.stop()


async def _listening(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while line := (await proc.stdout.readline()).decode():
            if m := re.search(r"listening on (http://\S+)", line):
                return m.group(1)
    raise AssertionError("the worker did not start listening")


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(url) as r:
        return r.status, await r.json()


@pytest.mark.timeout(180)
async def test_unreachable_redis_at_start_retries_then_becomes_ready(
    engine: RunningEngine,
) -> None:
    port = find_free_base_port(1)  # nothing listens there yet
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenrelay", "worker", "--port", "0",
        "--redis", f"redis://127.0.0.1:{port}", "--engine", f"e-start={engine.url}",
        "--insecure-no-auth",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")},
    )  # fmt: skip
    cluster: LocalCluster | None = None
    try:
        base = await _listening(proc)
        async with aiohttp.ClientSession() as http:
            assert (await _status(http, base + "/healthz"))[0] == 200
            status, body = await _status(http, base + "/readyz")
            assert status == 503
            assert body["error"] == "redis_unreachable"
            assert "redis_unreachable" in body["reasons"]  # type: ignore[operator]
            async with http.post(base + "/v1/sessions") as r:
                sid = (await r.json())["session"]
            async with http.post(f"{base}/v1/sessions/{sid}/turns", json={"message": "hi"}) as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "1"
                assert (await r.json())["error"] == "redis_unavailable"

            cluster = LocalCluster(masters=1, replicas=0, base_port=port)
            await cluster.start()
            async with asyncio.timeout(60):  # the retry backs off to at most 10 s
                while (await _status(http, base + "/readyz"))[0] != 200:
                    await asyncio.sleep(0.2)
            async with http.post(f"{base}/v1/sessions/{sid}/turns", json={"message": "hi"}) as r:
                assert r.status == 202, await r.text()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)  # by pid: the process this test started
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
        if cluster is not None:
            await cluster.stop()
    text = err.decode()
    assert proc.returncode == 0, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    assert "retrying in the background" in text


async def test_fail_fast_exits_1_with_one_line_naming_the_masked_url() -> None:
    port = find_free_base_port(1)  # nothing listens there
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenrelay", "worker", "--port", "0", "--fail-fast",
        "--redis", f"redis://default:s3cret-pass@127.0.0.1:{port}",
        "--engine", "http://127.0.0.1:9", "--insecure-no-auth",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")},
    )  # fmt: skip
    out, err_bytes = await asyncio.wait_for(proc.communicate(), 60)
    err = err_bytes.decode()
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"error: cannot connect to Redis at redis://default:***@127.0.0.1:{port}"
    )
    assert "s3cret-pass" not in err + out.decode()
    assert "listening" not in out.decode()


@pytest.mark.timeout(120)
async def test_a_refused_password_ends_the_start_without_fail_fast(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster = LocalCluster(masters=1, replicas=0, password="the-right-password-42")
    info = await cluster.start()
    try:
        host, port = info.startup_nodes[0]
        cfg = WorkerConfig(
            redis_url=f"redis://default:wrong-password-17@{host}:{port}",
            engines=[EngineSpec(id="e", url="http://127.0.0.1:9", cap=1)],
        )  # no retry can fix a refused password: exit 1 rather than retry forever
        assert await serve(cfg, "127.0.0.1", 0) == 1
    finally:
        await cluster.stop()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot connect to Redis at redis://default:***@{host}")
    assert "wrong-password-17" not in err
