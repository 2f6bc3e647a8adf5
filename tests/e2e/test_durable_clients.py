"""The official Durable Streams clients follow a stream through a relay failover.

Two ``tokenrelay relay`` processes on the suite's cluster, the open prefix
(``--durable-open-prefix``) on this test's paths. A writer appends numbered JSON
messages through relay B while a client follows the stream live (SSE, then long-poll)
through relay A; once the client has read some, relay A is SIGKILLed by its pid; the
client resumes from the last offset it was given, on relay B, and reads to the message
marked ``last``. What it read is every message once, in order, and exactly what the
stream holds in Redis (relay B's catch-up read from ``-1``, which reads Redis, and the
writer's own list).

- the TypeScript client ``@durable-streams/client`` (``clients/durable-clients/``,
  ``npm ci`` from its committed lock; ``follow.mjs`` moves to the next URL when the
  client's stream fails); skipped with the reason where node/npm or the registry is
  missing;
- the Python client ``durable-streams`` (the ``test`` extra): ``astream`` with
  ``iter_events("json_batches")``, its ``next_offset`` the resume point.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.peers.durable import routes_missing
from bench.relay.harness import RelayProc
from devstack.cluster.launcher import ClusterInfo
from devstack.procs import launched
from tests.support.npm import npm_ready
from tests.support.relay import relay_process

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients" / "durable-clients"
PREFIX = "failover/"
MESSAGES = 150  # appended at RATE/s: the kill comes after KILL_AFTER were read
RATE = 50.0
KILL_AFTER = 30
MODES = pytest.mark.parametrize("live", ["sse", "long-poll"])
JSON_CT = {"Content-Type": "application/json"}


@asynccontextmanager
async def _stack(
    cluster: ClusterInfo, tmp_path: Path
) -> AsyncIterator[tuple[RelayProc, RelayProc, aiohttp.ClientSession, str]]:
    """Relays A and B, a client session, and a new stream's path (created through B)."""
    why = await asyncio.to_thread(routes_missing)
    if why is not None:
        pytest.skip(why)
    flags = ("--durable-open-prefix", "/" + PREFIX)
    async with (
        relay_process(cluster, tmp_path, "ds-edge-a", *flags) as a,
        relay_process(cluster, tmp_path, "ds-edge-b", *flags) as b,
        aiohttp.ClientSession() as http,
    ):
        path = f"/v1/stream/{PREFIX}{uuid.uuid4().hex}"
        async with http.put(b.base + path, headers=JSON_CT) as r:
            assert r.status == 201, await r.text()
        yield a, b, http, path


async def _write(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """Append :data:`MESSAGES` numbered messages to ``url`` at :data:`RATE`/s; them."""
    sent = []
    for i in range(MESSAGES):
        msg: dict[str, Any] = {"i": i, "text": f"message {i}"}
        if i == MESSAGES - 1:
            msg["last"] = True
        async with http.post(url, data=json.dumps(msg), headers=JSON_CT) as r:
            assert r.status in (200, 204), await r.text()
        sent.append(msg)
        await asyncio.sleep(1 / RATE)
    return sent


async def _held(http: aiohttp.ClientSession, url: str) -> list[Any]:
    """The stream's whole log by catch-up reads from ``-1`` (the relay reads Redis)."""
    out: list[Any] = []
    offset = "-1"
    while True:
        async with http.get(url, params={"offset": offset}) as r:
            assert r.status == 200, await r.text()
            body = await r.read()
            out.extend(json.loads(body) if body.strip() else [])
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return out


async def _failover(
    cluster: ClusterInfo,
    tmp_path: Path,
    follow: Callable[[str, str], Coroutine[Any, Any, tuple[list[Any], int]]],
    progress: Callable[[], int],
) -> None:
    """Run ``follow(url_a, url_b)`` while writing; SIGKILL A once ``progress()`` says
    :data:`KILL_AFTER` messages were read; check what it read against Redis."""
    async with _stack(cluster, tmp_path) as (a, b, http, path):
        follower = asyncio.create_task(follow(a.base + path, b.base + path))
        writer = asyncio.create_task(_write(http, b.base + path))
        while progress() < KILL_AFTER:
            if follower.done():
                pytest.fail(f"the client ended before the kill: {follower.result()}")
            assert not writer.done(), "the writer ended before the client read enough"
            await asyncio.sleep(0.02)
        a.proc.kill()  # SIGKILL, mid-stream
        read_on_a = progress()
        sent = await asyncio.wait_for(writer, 60)
        items, switches = await asyncio.wait_for(follower, 60)
        held = await _held(http, b.base + path)
    assert read_on_a < MESSAGES, "the stream ended before the kill"
    assert switches >= 1, "the client never moved to relay B"
    assert held == sent, "Redis holds other messages than the writer's"
    assert [m["i"] for m in items] == list(range(MESSAGES)), "lost, repeated or reordered"
    assert items == held


@MODES
async def test_typescript_client_resumes_on_relay_b_after_a_sigkill(
    cluster: ClusterInfo, tmp_path: Path, live: str
) -> None:
    why = await npm_ready(CLIENTS, "@durable-streams/client")
    if why is not None:
        pytest.skip(why)
    node = shutil.which("node") or "node"
    log = tmp_path / "follow.log"
    got = re.compile(rb"^got (\d+) ", re.M)

    def progress() -> int:
        counts = got.findall(log.read_bytes()) if log.exists() else []
        return int(counts[-1]) if counts else 0

    async def follow(url_a: str, url_b: str) -> tuple[list[Any], int]:
        spec = json.dumps({"urls": [url_a, url_b], "offset": "-1", "live": live})
        argv = [node, str(CLIENTS / "follow.mjs"), spec]
        async with launched(argv, log=log, name="follow.mjs") as proc:
            code = await proc.wait(90)
        assert code == 0, log.read_text()[-3000:]
        print(log.read_text()[-3000:])
        out = json.loads(log.read_text().strip().splitlines()[-1])
        return out["items"], int(out["switches"])

    await _failover(cluster, tmp_path, follow, progress)


@MODES
async def test_python_client_resumes_on_relay_b_after_a_sigkill(
    cluster: ClusterInfo, tmp_path: Path, live: str
) -> None:
    ds = pytest.importorskip("durable_streams", reason="pip install -e '.[test]'")
    items: list[Any] = []

    async def follow(url_a: str, url_b: str) -> tuple[list[Any], int]:
        offset, switches, errors = "-1", -1, []
        for url in (url_a, *[url_b] * 20):
            switches += 1
            try:
                async with ds.astream(url, offset=offset, live=live) as res:
                    async for ev in res.iter_events(mode="json_batches"):
                        items.extend(ev.data)
                        offset = ev.next_offset
                        if any(isinstance(m, dict) and m.get("last") for m in ev.data):
                            return items, switches
            except Exception as exc:  # whatever the client raises: move on to relay B
                errors.append(repr(exc)[:200])
                await asyncio.sleep(0.1)
        raise AssertionError(f"never reached the last message: {errors}")

    await _failover(cluster, tmp_path, follow, lambda: len(items))
