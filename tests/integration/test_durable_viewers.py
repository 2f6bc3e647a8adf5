"""A session read through its Durable Streams view counts as a viewer, as an SSE or a
WebSocket screen does: the relay's presence says so while a live read waits, and a
turn read only there runs to its end instead of being stopped for ``no_viewers``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.mockengine.reply_length import ReplyLength
from relay.broker.rediscluster.store import RedisStore
from relay.producer.presence import present_relays
from tests.support.relay import Relay, running
from tests.support.worker import Harness

pytestmark = pytest.mark.integration

FAST_PRESENCE: dict[str, Any] = {"presence_grace_s": 1.0, "presence_interval_s": 0.2}
LONG_48 = ReplyLength(mean=48, max_tokens=48, min_tokens=48, sigma=0)  # every reply 48 tokens


@pytest.fixture
async def relay(cluster: ClusterInfo) -> AsyncIterator[Relay]:
    async with running(cluster, durable_long_poll_s=3.0, durable_sse_close_s=1.0) as r:
        yield r


async def _watchers(redis: RedisCluster, sid: str, want: int, within_s: float = 5.0) -> int:
    deadline = time.monotonic() + within_s
    while True:
        n = await present_relays(RedisStore(redis), sid)
        if n == want or time.monotonic() > deadline:
            return n
        await asyncio.sleep(0.05)


async def test_a_live_session_read_is_a_viewer_while_it_waits(
    relay: Relay, redis: RedisCluster
) -> None:
    sid = f"dsview-{time.monotonic_ns()}"
    params = {"offset": "-1", "live": "long-poll"}
    url, auth = relay.url(sid, "stream"), relay.auth(sid)
    poll = asyncio.create_task(relay.http.get(url, params=params, headers=auth).__aenter__())
    try:
        assert await _watchers(redis, sid, 1) == 1
    finally:
        resp = await poll
        resp.release()
    assert resp.status == 204  # nothing came: the poll ended empty
    assert await _watchers(redis, sid, 0) == 0  # the reader left: no longer counted
    async with relay.http.get(url, params={"offset": "-1"}, headers=auth) as r:
        assert r.status == 200  # a catch-up read waits for nothing: not a viewer
    assert await present_relays(RedisStore(redis), sid) == 0


async def _follow(relay: Relay, sid: str) -> list[dict[str, Any]]:
    """The session's frames read only through ``/v1/sessions/{sid}/stream?live=sse``
    (each response closes after ``durable_sse_close_s``: resumed at its last offset)
    until a terminal frame."""
    frames: list[dict[str, Any]] = []
    at = "-1"
    while not frames or frames[-1]["kind"] not in ("done", "error"):
        params = {"offset": at, "live": "sse"}
        async with relay.http.get(relay.url(sid, "stream"), params=params,
                                  headers=relay.auth(sid)) as r:  # fmt: skip
            assert r.status == 200, await r.text()
            kind, data = "", b""
            async for line in r.content:
                line = line.rstrip(b"\n")
                if line.startswith(b"event:"):
                    kind = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data += line[5:]
                elif not line and kind:
                    if kind == "data":
                        frames.extend(json.loads(data))
                    elif kind == "control":
                        at = json.loads(data)["streamNextOffset"]
                    kind, data = "", b""
    return frames


async def test_a_turn_read_only_through_the_durable_view_is_not_stopped(
    h: Harness, redis: RedisCluster, relay: Relay
) -> None:
    await h.start_engines(1, decode_tok_per_s=20.0, reply=LONG_48)  # 2.4 s > the grace
    await h.start_worker(**FAST_PRESENCE)
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "read as a durable stream"})
    assert status == 202
    async with asyncio.timeout(20):
        frames = await _follow(relay, sid)
    turn = [f for f in frames if f["turn"] == body["turn"]]
    assert turn[-1]["kind"] == "done", turn[-1]
    assert sum(1 for f in turn if f["kind"] == "token") >= 2
