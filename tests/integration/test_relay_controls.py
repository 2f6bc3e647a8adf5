"""The chat controls on the relay side, against the real cluster, through the streams a
browser opens (SSE, WebSocket, the AI SDK's UI stream) on relays of this process
(:func:`tests.support.relay.running`):

- the presence frame: screens on two relays learn the session's total and follow joins
  and leaves within seconds, a late joiner gets the count at once, a relay whose presence
  entry expired stops counting (the refresh script puts the total right), the last
  screen leaving removes the relay's field, and the SSE event moves no resume point;
- a deleted session: every open stream ends with the deleted notice and its close
  (SSE's ``: close session_deleted``, WebSocket 4410, the UI stream's error part), and a
  stream opened afterwards is refused with 410 ``session_deleted``, with a token minted
  before the delete too; a bystander session streams on;
- a compacted join (``?compact=1``) over SSE and WebSocket: each finished turn as meta,
  one merged token frame and its terminal frame, the running turn and the live frames
  frame by frame, the text and the offsets' continuity as a full join's; a ``compact``
  that is not a flag is a 400 ``invalid_compact``.

The delete is done here as docs/PROTOCOL.md "A deleted session" says a producer does it
(:func:`delete_session`), so that these tests do not depend on the worker's route.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.presence import WRITE_LUA, write_keys
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.protocol.auth import issue_token
from relay.protocol.frame import deleted_frame, encode
from relay.protocol.keys import (
    KeyKind,
    gone_key,
    hist_key,
    key,
    live_channel,
    log_key,
    meta_key,
    new_session_id,
    presence_key,
    screens_key,
)
from tests.support.relay import SECRET, STEP, Relay, publish_turn, running, sse, ws_frames
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration

# What a producer's delete does, in one script on the session's slot: every key of it
# gone, the tombstone written, the notice SPUBLISHed.
# KEYS: the tombstone, the live channel, then the keys to delete. ARGV: ttl_s, notice.
_DELETE = """
redis.call('DEL', unpack(KEYS, 3))
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
redis.call('SPUBLISH', KEYS[2], ARGV[2])
"""


async def delete_session(redis: RedisCluster, sid: str, ttl_s: int = 600) -> None:
    doomed = (meta_key(sid), log_key(sid), presence_key(sid), screens_key(sid), hist_key(sid),
              key(sid, KeyKind.HIST, "state"), key(sid, KeyKind.LOCK))  # fmt: skip
    keys = (gone_key(sid), live_channel(sid), *doomed)
    await redis.eval(_DELETE, len(keys), *keys, ttl_s, encode(deleted_frame(sid)))


def _token(sid: str) -> str:
    return issue_token(SECRET, sid, 300, time.time())


async def _refused(relay: Relay, sid: str, path: str, token: str, **params: str) -> None:
    """A stream of ``sid`` opened with ``token`` is refused with 410 session_deleted."""
    async with relay.http.get(
        relay.url(sid, path), params={"token": token, **params},
        headers={"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="} if path == "ws" else {},
    ) as resp:  # fmt: skip
        body: dict[str, Any] = await resp.json()
        assert resp.status == 410, (path, resp.status, body)
        assert body["error"] == "session_deleted"
        assert body["reason"]


PRESENCE_S = 5.0  # "within a few seconds": a count must be right by then


async def sse_count(client: SSEClient, n: int) -> None:
    """Read the SSE stream until its last presence frame says ``n`` screens."""
    async with asyncio.timeout(PRESENCE_S):
        while not client.presence or client.presence[-1]["meta"]["screens"] != n:
            client.feed(await client.resp.content.readany())
    assert client.presence[-1]["offset"] == 0


async def ws_count(ws: aiohttp.ClientWebSocketResponse, n: int) -> None:
    """Read the WebSocket until a presence frame says ``n`` screens."""
    async with asyncio.timeout(PRESENCE_S):
        while True:
            msg = await ws.receive()
            assert msg.type is WSMsgType.TEXT, msg
            f = json.loads(msg.data)
            if f.get("kind") == "presence" and f["meta"]["screens"] == n:
                return


async def test_screens_on_two_relays_learn_the_count_and_follow_joins_and_leaves(
    cluster: Any, redis: RedisCluster
) -> None:
    sid = new_session_id()
    await publish_turn(redis, sid, ["a", "b"])
    async with (
        running(cluster, relay_id="edge-a") as a,
        running(cluster, relay_id="edge-b") as b,
        sse(a, sid, params={"last_event_id": "0"}) as a1,
    ):
        assert len(await a1.events(3)) == 3
        await sse_count(a1, 1)
        async with b.http.ws_connect(b.url(sid, "ws"), params={"token": _token(sid)}) as b1:
            await asyncio.gather(sse_count(a1, 2), ws_count(b1, 2))
            async with sse(a, sid) as late:  # learns the count this relay knows, at once
                async with asyncio.timeout(1.0):
                    while not late.presence:
                        late.feed(await late.resp.content.readany())
                assert late.presence[0]["meta"]["screens"] in (2, 3)
                await asyncio.gather(sse_count(a1, 3), sse_count(late, 3), ws_count(b1, 3))
                assert await redis.hgetall(screens_key(sid)) == {b"edge-a": b"2", b"edge-b": b"1"}
            await asyncio.gather(sse_count(a1, 2), ws_count(b1, 2))
        await sse_count(a1, 1)  # the WebSocket on edge-b closed
        assert a1.last_id == "3"  # presence events have no id: the resume point stays
        # a relay that died: its field stays until its presence entry expires, then goes
        now_ms = int(time.time() * 1000)
        await redis.hset(screens_key(sid), "edge-dead", 4)
        await redis.zadd(presence_key(sid), {"edge-dead": now_ms + 2_500})
        offsets = await publish_turn(redis, sid, ["c"])  # (a write, so the count moves)
        assert [int(i) for i, _, _ in await a1.events(2)] == offsets
        async with sse(a, sid) as third:
            await sse_count(a1, 6)  # edge-a's 2 and edge-dead's 4, still live
            while int(time.time() * 1000) <= now_ms + 2_600:  # edge-dead's entry expires;
                await asyncio.sleep(0.1)  # a refresh notices
            ks = write_keys(sid)
            await redis.eval(WRITE_LUA, len(ks), *ks, "edge-a", 30_000, sid)
            await asyncio.gather(sse_count(a1, 2), sse_count(third, 2))
            assert await redis.hgetall(screens_key(sid)) == {b"edge-a": b"2"}
    async with asyncio.timeout(PRESENCE_S):  # the last screens left: edge-a's field went
        while await redis.hexists(screens_key(sid), "edge-a"):
            await asyncio.sleep(0.05)


async def test_a_deleted_sessions_streams_end_and_new_ones_are_refused(
    cluster: Any, redis: RedisCluster
) -> None:
    sid, bystander = new_session_id(), new_session_id()
    old_token = _token(sid)  # minted before the delete
    gen = await Publisher(redis).open_generation(sid)
    await gen.meta({"role": "user"})
    await gen.token("Hel")
    async with (
        running(cluster) as relay,
        sse(relay, sid, params={"last_event_id": "0"}) as a,
        sse(relay, bystander) as b,
        relay.http.ws_connect(relay.url(sid, "ws"), params={"from": "0", "token": old_token}) as ws,
        relay.http.get(relay.url(sid, "ui-stream"), params={"token": old_token}) as ui,
    ):
        assert ui.status == 200
        assert ui.headers["Connection"] == "close"  # the stream ends with its socket
        assert [k for _, k, _ in await a.events(2)] == ["meta", "token"]
        assert [f.get("kind") for f in await ws_frames(ws, 3)] == [None, "meta", "token"]
        await ui.content.readuntil(b'"delta":"Hel"')
        await delete_session(redis, sid)
        # SSE: the notice, then the close comment, then the end
        _, kind, notice = (await a.events(1))[0]
        assert (kind, notice["offset"], notice["meta"]) == ("reset", 0, {"code": "session_deleted"})
        await a.until_end()
        assert a.comments[-1] == "close session_deleted the session was deleted"
        # WebSocket: the notice, then close 4410
        (notice,) = await ws_frames(ws, 1)
        assert notice["meta"] == {"code": "session_deleted"}
        msg = await asyncio.wait_for(ws.receive(), STEP)
        assert msg.type is WSMsgType.CLOSE
        assert (ws.close_code, msg.extra) == (4410, "the session was deleted")
        # the UI stream: an error part, [DONE], the end
        rest = (await asyncio.wait_for(ui.content.read(), STEP)).decode()
        parts = [p[6:] for p in rest.split("\n\n") if p.startswith("data: ")]
        assert parts[-1] == "[DONE]"
        assert json.loads(parts[-3]) == {"type": "error", "errorText": "the session was deleted"}
        # refused from now on, on every route, with the token minted before the delete
        await _refused(relay, sid, "events", old_token)
        await _refused(relay, sid, "events", old_token, last_event_id="0")
        await _refused(relay, sid, "ws", old_token, **{"from": "1"})
        await _refused(relay, sid, "ui-stream", old_token)
        await _refused(relay, sid, "ws", _token(sid))
        # a bystander streams on
        offsets = await publish_turn(redis, bystander, ["still", " here"])
        assert [int(i) for i, _, _ in await b.events(3)] == offsets
        hub = relay.server.hub
        assert hub is not None
        assert hub.stats()["deleted"] == 1
    assert await redis.exists(presence_key(sid)) == 0  # the relay's presence went too


async def test_a_stream_opened_on_another_relay_after_the_delete_is_refused(
    cluster: Any, redis: RedisCluster
) -> None:
    sid = new_session_id()
    await publish_turn(redis, sid, ["a"])
    token = _token(sid)
    await delete_session(redis, sid)
    async with running(cluster, relay_id="edge-other") as relay:
        await _refused(relay, sid, "events", token)
        await _refused(relay, sid, "events", token, last_event_id="1")
        await _refused(relay, sid, "ws", token)
        async with aiohttp.ClientSession() as http:  # the AI SDK's resume URL as well
            url = f"{relay.base}/v1/chat/{sid}/stream"
            async with http.get(url, params={"token": token}) as resp:
                assert resp.status == 410
        hub = relay.server.hub
        assert hub is not None
        assert hub.stats()["channels"] == 0


async def _long_session(redis: RedisCluster, sid: str, turns: int, tokens: int) -> Any:
    """``turns`` finished turns of ``tokens`` token frames, then a running turn (meta and
    two tokens): its generation, to write on."""
    pub = Publisher(redis)
    for t in range(turns):
        gen = await pub.open_generation(sid)
        drafts = [Draft(kind="meta", meta={"role": "user", "message": f"q{t}"})]
        drafts += [Draft(kind="token", text=f"{t}.{i} ") for i in range(tokens)]
        await gen.publish([*drafts, Draft(kind="done")])
    gen = await pub.open_generation(sid)
    await gen.publish([Draft(kind="meta"), Draft(kind="token", text="r0 "),
                       Draft(kind="token", text="r1 ")])  # fmt: skip
    return gen


def _check_join(frames: list[dict[str, Any]], turns: int, tokens: int) -> None:
    assert [f["kind"] for f in frames[: 3 * turns]] == ["meta", "token", "done"] * turns
    assert [f["kind"] for f in frames[3 * turns :]] == ["meta", "token", "token"]
    last = 0
    for f in frames:
        meta = f.get("meta") or {}
        first = meta["from"] if "merged" in meta else f["offset"]
        assert first == last + 1, (last, f)
        last = f["offset"]
    text = "".join(f["text"] for f in frames if f["kind"] == "token")
    assert text == "".join(f"{t}.{i} " for t in range(turns) for i in range(tokens)) + "r0 r1 "


async def test_a_compacted_join_over_sse_and_websocket(cluster: Any, redis: RedisCluster) -> None:
    sid, turns, tokens = new_session_id(), 30, 20
    gen = await _long_session(redis, sid, turns, tokens)
    total = turns * (tokens + 2) + 3
    async with running(cluster) as relay:
        async with sse(relay, sid, params={"last_event_id": "0", "compact": "1"}) as client:
            frames = [f for _, _, f in await client.events(3 * turns + 3)]
            _check_join(frames, turns, tokens)
            live = await gen.token("live")  # live frames as they are
            ((_, kind, f),) = await client.events(1)
            assert (kind, f["offset"], f["meta"]) == ("token", live, {"gen": gen.gen})
        async with relay.http.ws_connect(
            relay.url(sid, "ws"), params={"from": "0", "compact": "true", "token": _token(sid)}
        ) as ws:
            hello, *frames = await ws_frames(ws, 1 + 3 * turns + 4)
            assert hello["type"] == "hello"
            assert frames[-1]["offset"] == total + 1
            _check_join(frames[:-1], turns, tokens)
        async with sse(relay, sid, params={"last_event_id": "0"}) as full:  # not asked: all
            assert len(await full.events(total + 1)) == total + 1
        for params in ({"compact": "yes"}, {"compact": "2"}):
            async with relay.http.get(
                relay.url(sid), params={"token": _token(sid), **params}
            ) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"] == "invalid_compact"
        hub = relay.server.hub
        assert hub is not None
        assert hub.stats()["compacted"] == 2 * turns * (tokens - 1)
