"""The Durable Streams routes of a relay on the real local cluster: writes, reads,
producers, live reads woken by SPUBLISH, chat sessions read as streams, auth, limits,
and a hostile batch that must leave every master's key count as it was."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.durable.auth import token_subject
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.relay import SECRET, Relay, publish_turn, running

pytestmark = pytest.mark.integration

OPEN = "open/"
JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def relay(cluster: ClusterInfo) -> AsyncIterator[Relay]:
    async with running(cluster, durable_open_prefix=OPEN, durable_long_poll_s=1.0,
                       durable_sse_close_s=2.0, durable_max_body_bytes=4096) as r:  # fmt: skip
        yield r


def _path() -> str:
    return f"{OPEN}{uuid.uuid4().hex}"


def _url(relay: Relay, path: str) -> str:
    return f"{relay.base}/v1/stream/{path}"


async def test_get_answers_on_both_routes(relay: Relay, redis: RedisCluster) -> None:
    """GET is served (not aiohttp's 405) on a stream and on a session's stream."""
    path = _path()
    async with relay.http.put(_url(relay, path), headers=JSON) as r:
        assert r.status == 201, await r.text()
    async with relay.http.get(_url(relay, path)) as r:
        assert r.status == 200, await r.text()
        assert await r.json() == []
    sid = new_session_id()
    await publish_turn(redis, sid, ["hel", "lo"])
    async with relay.http.get(relay.url(sid, "stream"), headers=relay.auth(sid)) as r:
        assert r.status == 200, await r.text()
        frames = await r.json()
    assert [f["text"] for f in frames if f["kind"] == "token"] == ["hel", "lo"]
    assert [f["offset"] for f in frames] == list(range(1, len(frames) + 1))
    assert r.headers["Stream-Next-Offset"] == f"{len(frames):016d}"
