"""The Durable Streams routes of a relay on the real local cluster: writes, reads,
producers, live reads woken by SPUBLISH, chat sessions read as streams, auth, limits,
and a hostile batch that must leave every master's key count as it was."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import seal
from relay.broker.rediscluster.streams import RedisStreams
from relay.durable import store
from relay.durable.auth import token_subject
from relay.durable.core import stream_id
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.relay import SECRET, Relay, publish_turn, running

pytestmark = pytest.mark.integration

OPEN = "open/"
JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def relay(cluster: ClusterInfo) -> AsyncIterator[Relay]:
    async with running(cluster, durable_open_prefix="/" + OPEN, durable_long_poll_s=1.0,
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
    assert r.headers["Stream-Next-Offset"] == f"{0:016d}_{len(frames):016d}"


async def test_writes_reads_and_json_mode(relay: Relay) -> None:
    url = _url(relay, _path())
    async with relay.http.put(url, headers=JSON, data=b'[{"a":1}]') as r:
        assert r.status == 201
        first = r.headers["Stream-Next-Offset"]
    async with relay.http.post(url, headers=JSON, data=b'[[1,2],{"b":2}]') as r:
        assert r.status == 204
        tail = r.headers["Stream-Next-Offset"]
    assert first < tail  # lexicographic: strictly increasing
    async with relay.http.get(url, params={"offset": "-1"}) as r:
        assert await r.json() == [{"a": 1}, [1, 2], {"b": 2}]
        assert r.headers["Stream-Up-To-Date"] == "true"
        etag = r.headers["ETag"]
    async with relay.http.get(url, params={"offset": "-1"}, headers={"If-None-Match": etag}) as r:
        assert r.status == 304
    async with relay.http.get(url, params={"offset": first}) as r:
        assert await r.json() == [[1, 2], {"b": 2}]
    async with relay.http.get(url, params={"offset": "now"}) as r:
        assert await r.json() == []
        assert r.headers["Cache-Control"] == "no-store"
        assert r.headers["Stream-Next-Offset"] == tail


async def test_producers_fence_dedupe_and_gap(relay: Relay) -> None:
    url = _url(relay, _path())
    async with relay.http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201

    async def post(epoch: int, seq: int, body: bytes = b"x") -> aiohttp.ClientResponse:
        h = {"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": str(epoch),
             "Producer-Seq": str(seq)}  # fmt: skip
        async with relay.http.post(url, headers=h, data=body) as r:
            await r.read()
            return r

    assert (await post(0, 0)).status == 200
    assert (await post(0, 0)).status == 204  # a retry: deduplicated
    gap = await post(0, 5)
    assert gap.status == 409
    assert (gap.headers["Producer-Expected-Seq"], gap.headers["Producer-Received-Seq"]) == (
        "1",
        "5",
    )
    assert (await post(1, 0)).status == 200
    stale = await post(0, 1)
    assert stale.status == 403
    assert stale.headers["Producer-Epoch"] == "1"
    async with relay.http.get(url) as r:
        assert await r.read() == b"xx"  # the duplicate, the gap and the zombie wrote nothing


async def test_long_poll_and_sse_wake_on_append(relay: Relay) -> None:
    url = _url(relay, _path())
    async with relay.http.put(url, headers=JSON) as r:
        tail = r.headers["Stream-Next-Offset"]
    poll = asyncio.create_task(
        relay.http.get(url, params={"offset": tail, "live": "long-poll"}).__aenter__()
    )
    await asyncio.sleep(0.2)
    async with relay.http.post(url, headers=JSON, data=b'{"n":1}') as r:
        assert r.status == 204
    resp = await asyncio.wait_for(poll, 5)
    assert resp.status == 200
    assert await resp.json() == [{"n": 1}]
    assert resp.headers["Stream-Cursor"]
    resp.release()
    async with relay.http.get(url, params={"offset": "now", "live": "long-poll"}) as r:
        assert r.status == 204  # the 1 s wait of this relay's --durable-long-poll-s
        assert r.headers["Stream-Up-To-Date"] == "true"
    async with relay.http.get(url, params={"offset": "-1", "live": "sse"}) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(r.content.readuntil(b"upToDate"), 5)  # data + control
        async with relay.http.post(url, headers=JSON, data=b'{"n":2}', params={}) as w:
            assert w.status == 204
        rest = await asyncio.wait_for(r.content.read(), 5)  # closed after 2 s
    text = (first + rest).decode()
    assert 'data:[{"n":1}]' in text
    assert 'data:[{"n":2}]' in text
    assert text.count("event: control") >= 2


async def test_closed_stream_is_eof(relay: Relay) -> None:
    url = _url(relay, _path())
    async with relay.http.put(url, headers={"Content-Type": "text/plain"}, data=b"a") as r:
        assert r.status == 201
    async with relay.http.post(url, headers={"Stream-Closed": "true"}) as r:
        assert r.status == 204
        assert r.headers["Stream-Closed"] == "true"
    async with relay.http.post(url, headers={"Content-Type": "text/plain"}, data=b"b") as r:
        assert r.status == 409
        assert r.headers["Stream-Closed"] == "true"
    async with relay.http.get(url, params={"offset": "now", "live": "long-poll"}) as r:
        assert r.status == 204
        assert r.headers["Stream-Closed"] == "true"


async def test_session_long_poll_follows_a_turn(relay: Relay, redis: RedisCluster) -> None:
    sid = new_session_id()
    await publish_turn(redis, sid, ["a"])
    url = relay.url(sid, "stream")
    async with relay.http.get(url, headers=relay.auth(sid)) as r:
        tail = r.headers["Stream-Next-Offset"]
        n = len(await r.json())
    poll = asyncio.create_task(
        relay.http.get(
            url, params={"offset": tail, "live": "long-poll"}, headers=relay.auth(sid)
        ).__aenter__()
    )
    await asyncio.sleep(0.2)
    await publish_turn(redis, sid, ["b"])
    resp = await asyncio.wait_for(poll, 5)
    frames = await resp.json()
    resp.release()
    assert frames[0]["offset"] == n + 1
    assert [f["text"] for f in frames if f["kind"] == "token"] == ["b"]


async def test_a_session_stream_goes_on_after_the_gap_frame_a_failover_left(
    relay: Relay, redis: RedisCluster
) -> None:
    """A ``gap`` frame stands at the last offset it covers (a relay's seal, a writer's skip
    after a failover), so the backlog's offsets jump there. The stream's next offset is
    the last frame's offset, not the count of frames read: counted, it pointed back
    before the gap, and the next read gave the gap frame again, then frames twice."""
    sid = new_session_id()
    await publish_turn(redis, sid, ["a"])
    url = relay.url(sid, "stream")
    async with relay.http.get(url, headers=relay.auth(sid)) as r:
        n = len(await r.json())
        tail = r.headers["Stream-Next-Offset"]
    assert await seal(redis, sid, n + 5, sealer="test") == 5  # offsets n+1 .. n+5: gone
    await publish_turn(redis, sid, ["b"])
    async with relay.http.get(url, params={"offset": tail}, headers=relay.auth(sid)) as r:
        frames = await r.json()
        tail = r.headers["Stream-Next-Offset"]
    assert [(f["kind"], f["offset"]) for f in frames] == [
        ("gap", n + 5),
        ("token", n + 6),
        ("done", n + 7),
    ]
    assert tail == f"{0:016d}_{n + 7:016d}"
    async with relay.http.get(url, params={"offset": tail}, headers=relay.auth(sid)) as r:
        assert await r.json() == []  # nothing twice
        assert r.headers["Stream-Next-Offset"] == tail


async def test_auth_scopes_and_limits(relay: Relay) -> None:
    path = f"private/{uuid.uuid4().hex}"
    url = _url(relay, path)
    async with relay.http.put(url, headers=JSON) as r:
        assert r.status == 401  # no token outside the open prefix
    now = time.time()
    watch = issue_token(SECRET, token_subject(path), 300, now)
    write = issue_token(SECRET, token_subject(path), 300, now, scope="write")
    other = issue_token(SECRET, token_subject("private/other"), 300, now, scope="write")
    async with relay.http.put(url, headers={**JSON, "Authorization": f"Bearer {other}"}) as r:
        assert r.status == 403
    async with relay.http.put(url, headers={**JSON, "Authorization": f"Bearer {watch}"}) as r:
        assert r.status == 403  # a read token does not write
    async with relay.http.put(url, headers={**JSON, "Authorization": f"Bearer {write}"}) as r:
        assert r.status == 201
    async with relay.http.get(url, headers={"Authorization": f"Bearer {watch}"}) as r:
        assert r.status == 200
        assert r.headers["Cache-Control"].startswith("private")
    async with relay.http.post(_url(relay, _path()), data=b"x" * 5000, headers=JSON) as r:
        assert r.status == 413


async def _key_counts(redis: RedisCluster) -> dict[str, int]:
    """DBSIZE of every master, by its address."""
    return {
        f"{n.host}:{n.port}": int(await redis.dbsize(target_nodes=n)) for n in redis.get_primaries()
    }


async def test_hostile_batch_writes_nothing(relay: Relay, redis: RedisCluster) -> None:
    """Every malformed request gets its 4xx with a reason; no master's key count moves."""
    existing = _url(relay, _path())
    async with relay.http.put(existing, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    fresh = _url(relay, _path())
    bad: list[tuple[str, str, dict[str, str], bytes, int]] = [
        ("PUT", fresh, {"Stream-TTL": "+60"}, b"", 400),
        ("PUT", fresh, {"Stream-TTL": "060"}, b"", 400),
        ("PUT", fresh, {"Stream-TTL": "1.5"}, b"", 400),
        ("PUT", fresh, {"Stream-Expires-At": "tomorrow"}, b"", 400),
        ("PUT", fresh, {"Stream-TTL": "5", "Stream-Expires-At": "2030-01-01T00:00:00Z"}, b"", 400),
        ("PUT", fresh, JSON, b"{not json", 400),
        ("PUT", fresh, JSON, b"x" * 5000, 413),
        ("POST", fresh, {"Content-Type": "text/plain"}, b"x", 404),
        ("POST", existing, {"Content-Type": "text/plain"}, b"", 400),
        ("POST", existing, {}, b"x", 400),
        ("POST", existing, {"Content-Type": "text/plain", "Producer-Id": "p"}, b"x", 400),
        (
            "POST",
            existing,
            {
                "Content-Type": "text/plain",
                "Producer-Id": "",
                "Producer-Epoch": "0",
                "Producer-Seq": "0",
            },
            b"x",
            400,
        ),
        (
            "POST",
            existing,
            {
                "Content-Type": "text/plain",
                "Producer-Id": "p",
                "Producer-Epoch": "-1",
                "Producer-Seq": "0",
            },
            b"x",
            400,
        ),
        (
            "POST",
            existing,
            {
                "Content-Type": "text/plain",
                "Producer-Id": "p",
                "Producer-Epoch": "9007199254740992",
                "Producer-Seq": "0",
            },
            b"x",
            400,
        ),
        ("POST", existing, {"Content-Type": "application/json"}, b"[]", 400),
        ("GET", existing + "?offset=abc", {}, b"", 400),
        ("GET", existing + "?offset=12", {}, b"", 400),
        ("GET", existing + "?live=sse", {}, b"", 400),
        ("GET", existing + "?offset=-1&live=forever", {}, b"", 400),
        ("GET", fresh, {}, b"", 404),
        ("HEAD", fresh, {}, b"", 404),
        ("DELETE", fresh, {}, b"", 404),
        ("PATCH", existing, {}, b"", 405),
    ]
    before = await _key_counts(redis)
    for method, url, headers, body, status in bad:
        async with relay.http.request(
            method, url, headers=headers, data=body, skip_auto_headers=("Content-Type",)
        ) as r:
            text = await r.text()
            assert r.status == status, (method, url, headers, r.status, text)
            if method != "HEAD":
                assert text.strip(), (method, url, headers, "no reason given")
    assert await _key_counts(redis) == before
    async with relay.http.get(existing) as r:
        assert await r.read() == b""


async def test_live_reads_per_address_limit(cluster: ClusterInfo) -> None:
    """A second read (live or catch-up) from one address past --max-streams-per-address
    is 429."""
    async with running(cluster, durable_open_prefix="/" + OPEN, max_streams_per_address=1,
                       durable_sse_close_s=5.0) as relay:  # fmt: skip
        url = _url(relay, _path())
        async with relay.http.put(url, headers=JSON) as r:
            assert r.status == 201
        async with relay.http.get(url, params={"offset": "-1", "live": "sse"}) as held:
            assert held.status == 200
            await asyncio.wait_for(held.content.readuntil(b"upToDate"), 5)
            async with relay.http.get(url, params={"offset": "now", "live": "long-poll"}) as r:
                assert r.status == 429
                assert "max-streams-per-address" in await r.text()
            async with relay.http.get(url, params={"offset": "-1"}) as r:
                assert r.status == 429  # a catch-up read counts too, while it lasts
        async with asyncio.timeout(10):  # the SSE read ends at --durable-sse-close-s
            while True:
                async with relay.http.get(url) as r:
                    if r.status == 200:
                        break
                    assert r.status == 429
                await asyncio.sleep(0.2)


async def test_a_read_copies_about_its_byte_budget_not_its_message_count(
    relay: Relay, redis: RedisCluster
) -> None:
    """The read script stops at the byte budget (one message at least): large messages
    are not all copied out of the log to be cut afterwards."""
    path = _path()
    async with relay.http.put(_url(relay, path)) as r:
        assert r.status == 201, await r.text()
    for i in range(6):  # 6 x 3 KB, under the fixture's 4 KB body limit
        async with relay.http.post(_url(relay, path), data=bytes([65 + i]) * 3000) as r:
            assert r.status == 204, await r.text()
    ref = store.StreamRef.of(path)
    streams = RedisStreams(redis)
    budget = await store.read(streams, ref, 0, count=1000, max_bytes=7000, touch=False)
    assert budget is not None
    assert budget.next == 6
    assert [m[:1] for m in budget.messages] == [b"A", b"B"]  # a third would pass 7,000
    one = await store.read(streams, ref, 2, count=1000, max_bytes=10, touch=False)
    assert one is not None
    assert [m[:1] for m in one.messages] == [b"C"]  # one at least
    every = await store.read(streams, ref, 0, count=1000, touch=False)
    assert every is not None
    assert len(every.messages) == 6  # no budget: the count


async def test_session_and_stream_tokens_never_open_each_other(relay: Relay) -> None:
    """A session may be named ``ds_<a stream's id>`` (apps choose session ids): its
    tokens still open no stream, and a stream's token opens no session."""
    path = f"private/{uuid.uuid4().hex}"
    url = _url(relay, path)
    now = time.time()
    stream_write = issue_token(SECRET, token_subject(path), 300, now, scope="write")
    async with relay.http.put(
        url, headers={**JSON, "Authorization": f"Bearer {stream_write}"}
    ) as r:
        assert r.status == 201
    lookalike = f"ds_{stream_id(path)}"  # the stream's old token subject
    session_write = issue_token(SECRET, lookalike, 300, now, scope="write")
    for method in ("GET", "POST"):
        headers = {**JSON, "Authorization": f"Bearer {session_write}"}
        async with relay.http.request(method, url, headers=headers, data=b"[1]") as r:
            assert r.status == 403, (method, await r.text())
    for sid in (lookalike, new_session_id()):
        bearer = {"Authorization": f"Bearer {stream_write}"}
        async with relay.http.get(relay.url(sid, "stream"), headers=bearer) as r:
            assert r.status == 403, await r.text()
        async with relay.http.get(relay.url(sid, "events"), headers=bearer) as r:
            assert r.status == 403, await r.text()
