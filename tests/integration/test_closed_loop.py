"""The closed loop: a turn streamed on the POST that started it, no relay in between.

An in-process worker (tests/support/worker.py) with mock engines on the real cluster,
and a real ``tokenrelay relay`` process for the "other screen". The source of truth is
the session's backlog in Redis: what the POST response carries must be byte for byte
the turn's frames there, and a relay viewer (or a reconnect through a relay with
``Last-Event-ID``) sees the same stream.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.frame import decode
from relay.protocol.sse_reader import SSEDecoder, SSEEvent
from tests.support.relay import RelayProcess, relay_process
from tests.support.worker import Harness, expected_reply, wait_turn

pytestmark = pytest.mark.integration


@pytest.fixture
async def relay(cluster: ClusterInfo, tmp_path: Path) -> AsyncIterator[RelayProcess]:
    async with relay_process(cluster, tmp_path, "edge-loop", "--heartbeat-s", "5") as r:
        yield r


_NOT_FRAMES = ("hello", "presence")  # the relay's hello and screen counts: not the session's


async def _read_sse(resp: aiohttp.ClientResponse, stop_after: int | None = None) -> list[SSEEvent]:
    dec, events = SSEDecoder(), []
    async for chunk in resp.content.iter_any():
        events += dec.feed(chunk)
        if stop_after is not None and sum(e.event not in _NOT_FRAMES for e in events) >= stop_after:
            break
    return events


async def _post_stream(
    h: Harness, sid: str, token: str, message: str, **body: object
) -> aiohttp.ClientResponse:
    assert h.http is not None
    return await h.http.post(
        h.url(f"/v1/sessions/{sid}/turns"),
        json={"message": message, **body},
        headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"},
    )


async def _backlog_turn(redis: RedisCluster, sid: str, turn: int) -> list[tuple[int, str, str]]:
    raw, _, _ = await read_backlog(redis, sid, 0, 100_000)
    return [(f.offset, f.kind, x.decode()) for f, x in ((decode(x), x) for x in raw)
            if f.turn == turn]  # fmt: skip


async def test_the_post_streams_exactly_the_turns_frames_in_the_relays_format(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    resp = await _post_stream(h, sid, token, "Tell me a story.", max_tokens=24)
    async with resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await _read_sse(resp)
    assert events[0].event == "hello"
    hello = json.loads(events[0].data)
    assert hello["session"] == sid
    got = [(int(e.id or 0), e.event, e.data) for e in events[1:]]
    want = await _backlog_turn(redis, sid, hello["turn"])
    assert got == want  # the same bytes, offsets and kinds as the source of truth
    assert hello["from"] == want[0][0] - 1
    assert got[0][1] == "meta"
    assert got[-1][1] == "done"
    text = "".join(json.loads(d)["text"] for _, k, d in got if k == "token")
    assert text == expected_reply([{"role": "user", "content": "Tell me a story."}], 24)


async def test_another_screen_and_a_reconnect_through_a_relay_see_the_same_stream(
    h: Harness, redis: RedisCluster, relay: RelayProcess
) -> None:
    await h.start_engines(1, decode_tok_per_s=60.0)
    await h.start_worker()
    sid, token = await h.session()
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        watcher = await http.get(f"{relay.base}/v1/sessions/{sid}/events",
                                 headers={**auth, "Last-Event-ID": "0"})  # fmt: skip
        resp = await _post_stream(h, sid, token, "A long answer, please.", max_tokens=40)
        async with resp:
            first = await _read_sse(resp, stop_after=4)  # the client drops mid-turn
        last_seen = max(int(e.id) for e in first if e.id is not None)
        resume = {**auth, "Last-Event-ID": str(last_seen)}
        async with http.get(f"{relay.base}/v1/sessions/{sid}/events", headers=resume) as again:
            dec, rest = SSEDecoder(), []
            async for chunk in again.content.iter_any():
                rest += [e for e in dec.feed(chunk) if e.event not in _NOT_FRAMES]
                if rest and rest[-1].event == "done":
                    break
        dec, other = SSEDecoder(), []
        async with watcher:
            async for chunk in watcher.content.iter_any():
                other += [e for e in dec.feed(chunk) if e.event not in _NOT_FRAMES]
                if other and other[-1].event == "done":
                    break
    frames = await wait_turn(redis, sid, 1)
    want = [(f.offset, f.kind) for f in frames]
    resumed = [(int(e.id or 0), e.event) for e in first if e.event not in _NOT_FRAMES]
    resumed += [(int(e.id or 0), e.event) for e in rest]
    assert resumed == want  # every frame once, in order, across the hop to a relay
    assert [(int(e.id or 0), e.event) for e in other] == want


async def test_an_attached_client_counts_as_a_watcher_and_a_gone_one_does_not(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1, decode_tok_per_s=10.0)
    await h.start_worker(presence_grace_s=0.4, presence_interval_s=0.1)
    sid, token = await h.session()
    t0 = time.monotonic()
    async with await _post_stream(h, sid, token, "slow and long", max_tokens=40) as resp:
        events = await _read_sse(resp)
    assert time.monotonic() - t0 > 2 * 0.4  # well past the grace, and no relay watched
    assert events[-1].event == "done"  # the closed-loop client kept it alive
    resp = await _post_stream(h, sid, token, "and again", max_tokens=40)
    async with resp:
        await _read_sse(resp, stop_after=2)  # then it leaves, and nobody else watches
    frames = await wait_turn(redis, sid, 2, timeout_s=20)
    assert frames[-1].kind == "error"
    assert frames[-1].text == "no viewers"  # presence rules as for any turn


async def test_a_stream_flag_of_the_wrong_type_is_a_400(h: Harness) -> None:
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "hi", "stream": "yes"})
    assert (status, body["error"]) == (400, "invalid_stream")
    status, body, _ = await h.post_turn(sid, token, {"message": "hi", "stream": False})
    assert status == 202
