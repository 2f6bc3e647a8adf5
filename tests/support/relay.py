"""A relay for tests: in this process (:func:`running`, a ``make_app`` on a free port) or
as a ``tokenrelay relay`` subprocess (:func:`relay_process`, so that its file
descriptors, memory and exit can be observed), plus the helpers their tests share.

Order of use::

    async with running(cluster, heartbeat_s=1) as relay:   # relay.base, .server, .http
        async with sse(relay, sid) as client: ...          # tests.support.sse.SSEClient
    async with relay_process(cluster, tmp_path, "edge-x", "--flag", "v") as proc:
        ...                                                # proc.base, .port, .pid, .log_path
    # stopped by pid on the way out; its log must hold no traceback

The subprocess is started and stopped with :mod:`devstack.procs` (log in a file, never
a pipe: a pipe nobody drains fills up and blocks the relay's event loop on a log write).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from redis.asyncio.cluster import RedisCluster

from bench.relay.harness import RelayProc
from devstack.cluster.launcher import ClusterInfo
from devstack.procs import free_port, http_ok, launched
from relay.broker.rediscluster.publisher import Publisher
from relay.edge.config import RelayConfig
from relay.edge.http.app import SERVER, make_app, make_runner
from relay.edge.http.server import EdgeServer
from relay.protocol.auth import issue_token
from relay.service.httpguard import GUARD, GuardedSite
from tests.support.sse import STEP, SSEClient
from tests.support.worker import SECRET as WORKER_SECRET

__all__ = [
    "SECRET",
    "STEP",
    "Relay",
    "RelayProcess",
    "publish_turn",
    "relay_process",
    "running",
    "send_expect_close",
    "sse",
    "wait_ready",
    "ws_frames",
]

SECRET = "test-secret-9d41c7e2b8a05f36c1d4e7a2b9f0"  # of the relays run by running()


class Relay:
    """A relay in this process: its base URL, its server object, a client session, and
    aiohttp's server under it (``web_server``: the HTTP connections aiohttp holds)."""

    def __init__(
        self,
        base: str,
        server: EdgeServer,
        http: aiohttp.ClientSession,
        web_server: web.Server | None = None,
    ) -> None:
        self.base, self.server, self.http = base, server, http
        self.web_server = web_server

    def url(self, sid: str, path: str = "events") -> str:
        return f"{self.base}/v1/sessions/{sid}/{path}"

    def auth(self, sid: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {issue_token(SECRET, sid, 300, time.time())}"}


@asynccontextmanager
async def running(cluster: ClusterInfo, **overrides: Any) -> AsyncIterator[Relay]:
    """A relay app on a free 127.0.0.1 port, served as ``tokenrelay relay`` serves it
    (its HTTP guard's site); ``overrides`` are :class:`RelayConfig` fields. These relays
    publish-test with bare generations (no worker, no turn lock), so the reaper is off
    unless overridden."""
    fields: dict[str, Any] = {
        "secret": SECRET, "relay_id": "edge-test", "reap_after_s": 0, **overrides
    }  # fmt: skip
    cfg = RelayConfig(port=0, redis_url=cluster.url, **fields)
    app = make_app(cfg)
    runner = make_runner(app, shutdown_timeout=2.0)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard=app[GUARD])
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            yield Relay(f"http://127.0.0.1:{port}", app[SERVER], http, runner.server)
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sse(relay: Relay, sid: str, **kw: Any) -> AsyncIterator[SSEClient]:
    """An SSE stream of ``sid`` on ``relay`` (authorized); its first line must be the
    ``retry:`` hint."""
    headers = {**relay.auth(sid), **kw.pop("headers", {})}
    async with relay.http.get(relay.url(sid), headers=headers, **kw) as resp:
        assert resp.status == 200, await resp.text()
        client = SSEClient(resp)
        first = await resp.content.readline()
        assert first.startswith(b"retry: "), first
        client.feed(first)
        yield client


async def wait_ready(http: aiohttp.ClientSession, base: str, within_s: float) -> None:
    """Poll a process's /readyz until it answers 200 (a started subprocess)."""
    async with asyncio.timeout(within_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(base + "/readyz") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)


async def ws_frames(
    ws: aiohttp.ClientWebSocketResponse, n: int, presence: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The next ``n`` WebSocket text messages, as JSON, but the ``presence`` frames (they
    come whenever a screen joins or leaves, outside the session's order): those go to
    ``presence`` when it is given, else nowhere."""
    out: list[dict[str, Any]] = []
    async with asyncio.timeout(STEP):
        while len(out) < n:
            msg = await ws.receive()
            assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
            obj = json.loads(msg.data)
            if obj.get("kind") == "presence":
                if presence is not None:
                    presence.append(obj)
                continue
            out.append(obj)
    return out


async def send_expect_close(
    ws: aiohttp.ClientWebSocketResponse, payload: str | bytes
) -> aiohttp.WSMessage:
    """Send ``payload`` (bytes: a binary message) and return the close the relay answers
    (presence frames that come before it are skipped)."""
    if isinstance(payload, bytes):
        await ws.send_bytes(payload)
    else:
        await ws.send_str(payload)
    async with asyncio.timeout(STEP):
        msg = await ws.receive()
        while msg.type is WSMsgType.TEXT and json.loads(msg.data).get("kind") == "presence":
            msg = await ws.receive()
    assert msg.type is WSMsgType.CLOSE, msg
    return msg


async def publish_turn(redis: RedisCluster, sid: str, texts: list[str]) -> list[int]:
    """One turn of bare token frames and a ``done``; their offsets."""
    gen = await Publisher(redis).open_generation(sid)
    offsets = [await gen.token(t) for t in texts]
    offsets.append(await gen.done())
    return offsets


RelayProcess = RelayProc  # a relay subprocess: .proc, .port, .base, .pid, .log_path


@asynccontextmanager
async def relay_process(
    cluster: ClusterInfo, log_dir: Path, relay_id: str, *flags: str, wrap: Sequence[str] = ()
) -> AsyncIterator[RelayProcess]:
    """``tokenrelay relay`` as a subprocess (token secret: the worker harness's), ready
    to serve; stopped by pid on the way out; its log (``log_dir/<relay_id>.log``) must
    hold no traceback. ``wrap``: a command that execs the rest (its pid is the relay's),
    e.g. ``("prlimit", "--nofile=256")``."""
    port = free_port()
    argv = [
        *wrap, sys.executable, "-m", "tokenrelay", "relay", "--port", str(port),
        "--redis", cluster.url, "--secret", WORKER_SECRET, "--relay-id", relay_id,
        "--log-level", "INFO", *flags,
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    log = log_dir / f"{relay_id}.log"
    async with launched(argv, log=log, ready=http_ok(base + "/readyz"), name=relay_id) as proc:
        yield RelayProc(proc, port)
    err = log.read_bytes()
    print(f"relay log: {len(err)} bytes, {err.count(b'Traceback')} tracebacks")
    assert b"Traceback" not in err, err[-4000:].decode(errors="replace")
