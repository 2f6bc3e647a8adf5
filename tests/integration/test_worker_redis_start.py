"""A worker whose Redis is unreachable at start: a real process keeps retrying in the
background (/healthz 200, /readyz 503 ``redis_unreachable``, turns 503) and becomes ready
once a cluster comes up on that port; with ``fail_fast`` it exits 1 with one line that
names the URL without its password."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from devstack.cluster.launcher import LocalCluster, find_free_base_port
from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from devstack.procs import Proc
from tests.support.cli import clean_env, run_cli, tokenrelay
from worker.cli import serve
from worker.config import WorkerConfig

pytestmark = pytest.mark.integration


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    running = await start_engine(EngineConfig(port=0, engine_id="e-start"))
    try:
        yield running
    finally:
        await running.stop()


async def _listening(proc: Proc) -> str:
    """The URL of the worker's "listening on" line (a whole line, on its stdout)."""
    async with asyncio.timeout(30):
        while not (m := re.search(r"listening on (http://\S+)\n", proc.output())):
            proc.check()  # exited: ProcError with its stdout's last lines
            await asyncio.sleep(0.1)
    return m.group(1)


async def _status(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(url) as r:
        return r.status, await r.json()


@pytest.mark.timeout(180)
async def test_unreachable_redis_at_start_retries_then_becomes_ready(
    engine: RunningEngine, tmp_path: Path
) -> None:
    port = find_free_base_port(1)  # nothing listens there yet
    proc = Proc.start(
        tokenrelay("worker", "--port", "0", "--redis", f"redis://127.0.0.1:{port}",
                   "--engine", f"e-start={engine.url}", "--insecure-no-auth",
                   # the live-session cap counts in Redis (a creation while Redis is away
                   # is a 503 then); this test creates its session before Redis is up
                   "--max-sessions-per-address", "0"),
        log=tmp_path / "worker.out", err_log=tmp_path / "worker.err", env=clean_env(),
        name="worker",
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
        code = await proc.stop(grace_s=30)  # SIGTERM by pid: the process this test started
        if cluster is not None:
            await cluster.stop()
    text = proc.output(stderr=True)
    assert code == 0, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    assert "retrying in the background" in text


async def test_fail_fast_exits_1_with_one_line_naming_the_masked_url() -> None:
    port = find_free_base_port(1)  # nothing listens there
    ran = await run_cli(
        tokenrelay("worker", "--port", "0", "--fail-fast",
                   "--redis", f"redis://default:s3cret-pass@127.0.0.1:{port}",
                   "--engine", "http://127.0.0.1:9", "--insecure-no-auth"),
        env=clean_env(), timeout_s=60,
    )  # fmt: skip
    out, err = ran.out, ran.err
    assert ran.code == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"error: cannot connect to Redis at redis://default:***@127.0.0.1:{port}"
    )
    assert "s3cret-pass" not in err + out
    assert "listening" not in out


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
            engine_urls=("e=http://127.0.0.1:9",),
            engine_cap=1,
        )  # no retry can fix a refused password: exit 1 rather than retry forever
        assert await serve(cfg, "127.0.0.1", 0) == 1
    finally:
        await cluster.stop()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot connect to Redis at redis://default:***@{host}")
    assert "wrong-password-17" not in err
