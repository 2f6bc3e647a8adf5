"""A client resumes with the generation it holds (``gen``): a session that restarted
meanwhile answers with a ``reset`` frame and its new generation from offset 1, over SSE,
over WebSocket and through the Python client; a bad ``gen`` is a 400 with its reason;
a ``gap`` frame a relay makes for one client carries the generation of its backlog.
On the real cluster, through an in-process relay (docs/PROTOCOL.md, "Session
generations and the reset frame")."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.client.stream import watch
from relay.protocol.auth import issue_token
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame
from relay.protocol.keys import log_key, meta_key, new_session_id
from tests.support.relay import SECRET, STEP, Relay, running, sse, ws_frames

pytestmark = pytest.mark.integration


async def turn(redis: RedisCluster, sid: str, texts: list[str], maxlen: int = 10_000) -> str:
    """One turn of token frames and a ``done``; the session's generation id."""
    gen = await Publisher(redis, maxlen=maxlen).open_generation(sid)
    for t in texts:
        await gen.token(t)
    await gen.done()
    return gen.gen


async def expire(redis: RedisCluster, sid: str) -> None:
    """What ``--session-ttl-s`` does to an idle session: its keys are gone."""
    await redis.delete(meta_key(sid), log_key(sid))


async def restarted(redis: RedisCluster, sid: str) -> tuple[str, str]:
    """Generation ``old`` wrote offsets 1..6, expired; ``new`` wrote 1..4 (3 tokens,
    done): a client of ``old`` holding offset 3 holds an offset ``new`` reached too."""
    old = await turn(redis, sid, ["o1", "o2", "o3", "o4", "o5"])
    await expire(redis, sid)
    new = await turn(redis, sid, ["n1", "n2", "n3"])
    assert new != old
    return old, new


def reset_meta(new: str, old: str) -> dict[str, str]:
    return {"gen": new, "previous_gen": old, "code": "session_reset"}


async def test_sse_resume_with_an_older_gen_gets_a_reset_then_the_new_generation_once(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    async with running(cluster) as relay:
        old, new = await restarted(redis, sid)
        resume = {"headers": {"Last-Event-ID": "3"}, "params": {"gen": old}}
        async with sse(relay, sid, **resume) as client:
            events = await client.events(5)
            assert [(i, kind) for i, kind, _ in events] == [
                ("0", "reset"), ("1", "token"), ("2", "token"), ("3", "token"), ("4", "done")
            ]  # fmt: skip
            assert events[0][2]["meta"] == reset_meta(new, old)
            assert [d["text"] for _, _, d in events[1:4]] == ["n1", "n2", "n3"]
            assert all(d["meta"]["gen"] == new for _, _, d in events[1:])
            await turn(redis, sid, ["m1"])  # live, right after: no frame twice, none missing
            more = await client.events(2)
            assert [(i, d["text"]) for i, _, d in more] == [("5", "m1"), ("6", "")]
        # the current generation with an offset it has: as always, no reset
        async with sse(relay, sid, headers={"Last-Event-ID": "4"}, params={"gen": new}) as c2:
            assert [(i, d["text"]) for i, _, d in await c2.events(2)] == [("5", "m1"), ("6", "")]


async def test_websocket_resume_with_an_older_gen_gets_a_reset_then_the_new_generation_once(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    async with running(cluster) as relay:
        old, new = await restarted(redis, sid)
        params = {"token": token, "from": "3", "gen": old}
        async with relay.http.ws_connect(relay.url(sid, "ws"), params=params) as ws:
            hello, *frames = await ws_frames(ws, 6)
            assert (hello["type"], hello["from"]) == ("hello", 3)
            assert [(f["kind"], f["offset"]) for f in frames] == [
                ("reset", 0), ("token", 1), ("token", 2), ("token", 3), ("done", 4)
            ]  # fmt: skip
            assert frames[0]["meta"] == reset_meta(new, old)
            await turn(redis, sid, ["m1"])
            assert [f["offset"] for f in await ws_frames(ws, 2)] == [5, 6]


async def test_a_gen_of_a_session_that_has_none_now_is_served_live_and_reset_on_the_new_one(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    async with running(cluster) as relay:
        old = await turn(redis, sid, ["o1", "o2"])
        await expire(redis, sid)  # no new turn yet: the session has no generation
        async with sse(relay, sid, headers={"Last-Event-ID": "4"}, params={"gen": old}) as client:
            new = await turn(redis, sid, ["n1"])
            events = await client.events(3)
            assert [(i, kind) for i, kind, _ in events] == [
                ("0", "reset"), ("1", "token"), ("2", "done")
            ]  # fmt: skip
            assert events[0][2]["meta"] == reset_meta(new, old)


BAD_GENS = ["x" * 65, "a b", "g\u00e4", "{x}", "a/b", "a%00"]


async def test_a_bad_gen_is_a_400_invalid_gen_with_its_reason_on_both_endpoints(
    cluster: ClusterInfo,
) -> None:
    sid = new_session_id()
    async with running(cluster) as relay:
        for raw in BAD_GENS:
            for path, extra in (("events", {}), ("ws", {"from": "1"})):
                params = {"gen": raw, **extra}
                async with relay.http.get(
                    relay.url(sid, path), params=params, headers=relay.auth(sid)
                ) as r:
                    body = await r.json()
                assert (r.status, body["error"]) == (400, "invalid_gen"), (raw, path, body)
                assert "gen" in body["reason"], body
        token = issue_token(SECRET, sid, 300, time.time())
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await relay.http.ws_connect(relay.url(sid, "ws"), params={"token": token, "gen": "a b"})
        assert refused.value.status == 400
        # empty is absent, as for the offsets: served as without gen
        async with sse(relay, sid, params={"gen": ""}) as client:
            assert client.resp.status == 200


async def test_a_gap_frame_made_for_one_client_carries_the_generation_of_its_backlog(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    pub = Publisher(redis, maxlen=5)
    g = await pub.open_generation(sid)
    for _ in range(4):
        await g.publish([Draft(kind="token", text="t")] * 100)  # trimmed to the last ~100
    async with (
        running(cluster) as relay,
        sse(relay, sid, headers={"Last-Event-ID": "0"}) as client,
    ):
        (i, kind, gap), (j, _, first) = await client.events(2)
    assert kind == "gap"
    assert gap["meta"]["from"] == 1
    assert (int(i), int(j)) == (gap["meta"]["to"], gap["meta"]["to"] + 1)
    assert gap["meta"]["gen"] == g.gen == first["meta"]["gen"]


# -- the Python client ----------------------------------------------------------------------


async def kick_all(relay: Relay) -> None:
    """End every stream of the relay (a drain would: the clients reconnect)."""
    for stream in list(relay.server.streams):
        stream.kick(CloseCode.RELAY_SHUTDOWN, "test: reconnect")


@pytest.mark.parametrize("transport", ["sse", "ws"])
async def test_the_python_client_sends_its_gen_on_reconnect_and_gets_the_reset(
    cluster: ClusterInfo, redis: RedisCluster, transport: str
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    async with running(cluster) as relay:
        old = await turn(redis, sid, ["o1", "o2", "o3", "o4", "o5"])  # offsets 1..6
        up: list[str] = [relay.base]  # the relays "up now": none while the session restarts
        got: list[Frame] = []
        w = watch(lambda: up, sid, token, 0, transport=transport,  # type: ignore[arg-type]
                  base_s=0.05, max_s=0.2)  # fmt: skip

        async def read() -> None:
            async for f in w:
                if f.kind != "presence":  # a screen count, outside the offsets
                    got.append(f)

        reader = asyncio.create_task(read())
        try:
            async with asyncio.timeout(STEP):
                while len(got) < 6:
                    await asyncio.sleep(0.01)
                assert w.last == 6
                up.clear()
                await kick_all(relay)
                while relay.server.streams:
                    await asyncio.sleep(0.01)
                await expire(redis, sid)  # while the client is away, the session restarts
                new = await turn(redis, sid, ["n1", "n2", "n3", "n4", "n5", "n6", "n7"])
                up.append(relay.base)  # it comes back with offset 6 and the old gen
                while len(got) < 6 + 9:
                    await asyncio.sleep(0.01)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await w.aclose()
    again = got[6:]
    assert [(f.kind, f.offset) for f in again] == [("reset", 0)] + [
        ("token", i) for i in range(1, 8)
    ] + [("done", 8)]  # fmt: skip
    assert again[0].meta == reset_meta(new, old)
    assert [f.text for f in again[1:8]] == ["n1", "n2", "n3", "n4", "n5", "n6", "n7"]
    assert (w.last, w.stats.problems, w.stats.duplicates) == (8, 0, 0)
    assert w.gen == new


async def test_the_python_client_resumes_with_a_gen_it_is_given(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    sid = new_session_id()
    token = issue_token(SECRET, sid, 300, time.time())
    async with running(cluster) as relay:
        old, new = await restarted(redis, sid)
        w = watch(relay.base, sid, token, 3, gen=old)
        got: list[Any] = []
        async with asyncio.timeout(STEP):
            async for f in w:
                got.append((f.kind, f.offset))
                if f.kind == "done":
                    break
        await w.aclose()
    assert got == [("reset", 0), ("token", 1), ("token", 2), ("token", 3), ("done", 4)]
    assert w.gen == new
