"""Replays of a long session against a real cluster: a session of 1,450 short turns
(about 9,400 offsets) watched from 0 over SSE and WebSocket, 50 replays at once within
the relay's byte budget, a socket that stops reading mid-replay, and the fast (direct
write) and queued (pushed-back socket) paths writing the same bytes.

The raw-socket clients here speak HTTP/1.1 themselves so that the test can stop reading
(a small receive buffer) and see the exact body bytes the relay wrote (chunks removed).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import WSMsgType
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from relay.protocol.sse_reader import SSEDecoder
from tests.support.relay import SECRET as SERVER_SECRET
from tests.support.relay import relay_process, running
from tests.support.worker import SECRET as PROCESS_SECRET

pytestmark = pytest.mark.integration

TURNS = 1_450
MESSAGE = "m" * 1_000  # the user's message rides on each turn's meta frame


@pytest.fixture(scope="module")
async def big_session(cluster: ClusterInfo) -> tuple[str, int]:
    """A session of 1,450 short turns: meta (with the message), 4 or 5 tokens, done."""
    host, port = cluster.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port)
    await redis.initialize()
    try:
        sid = new_session_id()
        pub = Publisher(redis)
        last = 0
        for turn in range(TURNS):
            gen = await pub.open_generation(sid)
            drafts = [Draft(kind="meta", meta={"message": MESSAGE, "turn": turn})]
            drafts += [Draft(kind="token", text=f" w{turn}.{i}") for i in range(4 + turn % 2)]
            drafts.append(Draft(kind="done"))
            last = (await gen.publish(drafts))[-1]
    finally:
        await redis.aclose()
    return sid, last


def covered(frames: list[dict[str, Any]]) -> list[int]:
    """Offsets delivered; a merged token frame counts for its ``from``..``offset`` range."""
    out: list[int] = []
    for f in frames:
        meta = f.get("meta") or {}
        start = int(meta["from"]) if f["kind"] == "token" and "merged" in meta else f["offset"]
        out.extend(range(start, f["offset"] + 1))
    return out


class RawSSE:
    """An SSE request over a plain socket: the body bytes as written (chunked framing
    removed), read only when the test asks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.body = bytearray()
        self.eof = False

    @classmethod
    async def open(
        cls, port: int, sid: str, token: str, last_id: int | None, rcvbuf: int = 0
    ) -> RawSSE:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        head = f"GET /v1/sessions/{sid}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += f"Authorization: Bearer {token}\r\n"
        if last_id is not None:
            head += f"Last-Event-ID: {last_id}\r\n"
        writer.write((head + "\r\n").encode())
        client = cls(reader, writer)
        status = await reader.readuntil(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 200"), status
        assert b"transfer-encoding: chunked" in status.lower()
        return client

    async def read_chunk(self) -> bool:
        size_line = await self.reader.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        if size == 0:
            self.eof = True
            return False
        self.body += await self.reader.readexactly(size)
        assert await self.reader.readexactly(2) == b"\r\n"
        return True

    def frames(self) -> list[dict[str, Any]]:
        """The frames in the body so far (the project's SSE decoder; the hello and the
        presence frames, outside the session's order, left out)."""
        events = SSEDecoder().feed(bytes(self.body))
        return [orjson.loads(e.data) for e in events if e.event not in ("hello", "presence")]

    async def read_until_offset(self, last: int, within_s: float) -> list[dict[str, Any]]:
        async with asyncio.timeout(within_s):
            while f"id: {last}\n".encode() not in self.body[-4096:]:
                assert await self.read_chunk(), "the stream ended"
        return self.frames()

    def close(self) -> None:
        self.writer.transport.abort()


def _token(sid: str, secret: str) -> str:
    return issue_token(secret, sid, 600, time.time())


async def test_a_1450_turn_session_replays_from_0_over_sse_and_websocket(
    cluster: ClusterInfo, big_session: tuple[str, int]
) -> None:
    sid, last = big_session
    assert last > 9_000
    async with running(cluster) as relay:
        port = int(relay.base.rsplit(":", 1)[1])
        client = await RawSSE.open(port, sid, _token(sid, SERVER_SECRET), 0)
        try:
            frames = await client.read_until_offset(last, 60)
        finally:
            client.close()
        assert covered(frames) == list(range(1, last + 1))
        assert b": close" not in client.body  # never cut as slow
        ws_got: list[dict[str, Any]] = []
        url = relay.url(sid, "ws")
        async with relay.http.ws_connect(url, params={"from": "0"}, headers=relay.auth(sid)) as ws:
            assert orjson.loads((await ws.receive()).data)["type"] == "hello"
            async with asyncio.timeout(60):
                while not ws_got or ws_got[-1]["offset"] < last:
                    msg = await ws.receive()
                    assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
                    if (frame := orjson.loads(msg.data))["kind"] != "presence":
                        ws_got.append(frame)
        assert covered(ws_got) == list(range(1, last + 1))
        assert relay.server.metrics.slow_disconnects.labels("sse")._value.get() == 0
        assert relay.server.metrics.slow_disconnects.labels("ws")._value.get() == 0


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


@pytest.mark.timeout(300)
async def test_fifty_parallel_replays_stay_within_the_budget(
    cluster: ClusterInfo, big_session: tuple[str, int], tmp_path: Path
) -> None:
    sid, last = big_session
    budget = 4 << 20
    margin_kb = 24 * 1024  # 50 transports at their high-water mark, parsers, allocator slack
    async with relay_process(
        cluster, tmp_path, "replay-50", "--replay-budget-bytes", str(budget)
    ) as relay:
        pid = relay.proc.pid
        warm = await RawSSE.open(relay.port, sid, _token(sid, PROCESS_SECRET), last - 10)
        try:  # warm up with one short replay, then measure
            await warm.read_until_offset(last, 30)
        finally:
            warm.close()
        base_kb = _rss_kb(pid, "VmRSS")
        clients = [
            await RawSSE.open(relay.port, sid, _token(sid, PROCESS_SECRET), 0) for _ in range(50)
        ]
        try:
            results = await asyncio.gather(*(c.read_until_offset(last, 240) for c in clients))
        finally:
            for c in clients:
                c.close()
        peak_kb = _rss_kb(pid, "VmHWM")
        session_kb = sum(len(c.body) for c in clients) // 1024
    for frames in results:
        assert covered(frames) == list(range(1, last + 1))
    print(f"relay RSS {base_kb} KB -> peak {peak_kb} KB; {session_kb} KB replayed")
    assert session_kb > 5 * (budget // 1024 + margin_kb)  # holding it all would not fit
    assert peak_kb - base_kb < budget // 1024 + margin_kb


async def test_a_socket_that_stops_reading_mid_replay_is_cut_and_stalls_nobody(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid, live_sid = new_session_id(), new_session_id()
    pub = Publisher(redis, max_bytes=16 << 20)  # past the default budget: kept whole
    for turn in range(400):  # about 12 MB: more than the kernel buffers of a socket
        gen = await pub.open_generation(sid)
        drafts = [Draft(kind="meta", meta={"message": "q" * 30_000, "turn": turn})]
        last = (await gen.publish([*drafts, Draft(kind="token", text="a"), Draft(kind="done")]))[-1]
    async with running(cluster, write_timeout_s=0.5) as relay:
        port = int(relay.base.rsplit(":", 1)[1])
        stuck = await RawSSE.open(port, sid, _token(sid, SERVER_SECRET), 0, rcvbuf=4096)
        await stuck.read_chunk()  # the hello, then it stops reading
        reader = await RawSSE.open(port, sid, _token(sid, SERVER_SECRET), 0)
        live = await RawSSE.open(port, live_sid, _token(live_sid, SERVER_SECRET), None)
        await live.read_chunk()
        gen = await Publisher(redis).open_generation(live_sid)
        metrics = relay.server.metrics
        try:
            frames = await reader.read_until_offset(last, 60)
            assert covered(frames) == list(range(1, last + 1))
            offsets = [await gen.token(f"t{i}") for i in range(20)]
            got = await live.read_until_offset(offsets[-1], 10)
            assert [f["offset"] for f in got] == offsets
            async with asyncio.timeout(10):
                while metrics.slow_disconnects.labels("sse")._value.get() < 1:
                    await asyncio.sleep(0.05)
        finally:
            for c in (stuck, reader, live):
                c.close()
        assert metrics.slow_disconnects.labels("sse")._value.get() == 1
        hub = relay.server.hub
        assert hub is not None
        async with asyncio.timeout(5):  # the cut stream's replay budget came back
            while hub.stats()["replay_budget_used"]:
                await asyncio.sleep(0.05)


async def test_direct_and_queued_writes_put_the_same_bytes_on_the_wire(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    # no presence frames: the two sockets' counts would arrive at different points
    roomy = {"queue_frames": 100_000, "hard_limit_frames": 200_000, "presence_interval_s": 0}
    async with running(cluster, max_pending_bytes=64 << 20, **roomy) as relay:
        port = int(relay.base.rsplit(":", 1)[1])
        token = _token(sid, SERVER_SECRET)
        fast = await RawSSE.open(port, sid, token, None)
        slow = await RawSSE.open(port, sid, token, None, rcvbuf=4096)
        for c in (fast, slow):
            await c.read_chunk()  # the hello
        gen = await Publisher(redis).open_generation(sid)
        hub = relay.server.hub
        assert hub is not None
        before = hub.stats()
        turns, tokens = 80, 50
        reading = asyncio.create_task(fast.read_until_offset(turns * (tokens + 1) + 1, 60))
        last = 0
        for turn in range(turns):  # 8 MB: far more than the slow socket's kernel buffers
            drafts = [Draft(kind="meta", meta={"message": MESSAGE * 100, "turn": turn})]
            drafts += [Draft(kind="token", text=f" tok{turn}.{i}") for i in range(tokens)]
            last = (await gen.publish(drafts))[-1]
        await gen.done()
        last += 1
        try:
            async with asyncio.timeout(10):  # the slow socket pushed back: frames wait queued
                while not any(s.watch.pending for s in relay.server.streams):
                    await asyncio.sleep(0.05)
            await reading
            await slow.read_until_offset(last, 30)
        finally:
            reading.cancel()
            fast.close()
            slow.close()
        assert hub.stats()["writes_queued"] > before["writes_queued"]
        assert covered(slow.frames()) == list(range(1, last + 1))  # nothing merged
        assert bytes(slow.body) == bytes(fast.body)
        assert hub.stats()["writes_direct"] > before["writes_direct"]
