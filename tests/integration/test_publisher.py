"""The publisher against a real cluster: one round trip, offsets, fencing, trimming."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

import relay.broker.rediscluster.publisher as publisher_mod
from relay.broker.errors import Fenced
from relay.broker.rediscluster.publisher import Draft, Publisher, read_backlog
from relay.protocol.frame import Frame, decode
from relay.protocol.keys import live_channel, log_key, meta_key, new_session_id

pytestmark = pytest.mark.integration


async def _node_for(redis: RedisCluster, key: str) -> aioredis.Redis:
    node = redis.get_node_from_key(key)
    assert node is not None
    return aioredis.Redis(host=node.host, port=int(node.port))


async def _cmdstat(node: aioredis.Redis, name: str) -> int:
    info = await node.info("commandstats")
    return int(info.get(f"cmdstat_{name}", {}).get("calls", 0))


async def test_open_generation_bumps_epoch_and_turn(redis: RedisCluster) -> None:
    pub = Publisher(redis)
    sid = new_session_id()
    g1 = await pub.open_generation(sid)
    g2 = await pub.open_generation(sid)
    assert (g1.epoch, g1.turn, g1.offset) == (1, 1, 0)
    # turn 1 never ended: the next open ends it first, with one error frame at offset 1
    assert (g2.epoch, g2.turn, g2.next_offset) == (2, 2, 2)
    (ended,), _, _ = await read_backlog(redis, sid, 0, 10)
    f = decode(ended)
    assert (f.turn, f.offset, f.kind, f.epoch) == (1, 1, "error", 2)
    assert (f.meta or {})["code"] == "superseded"
    assert g2._written[1] == ended  # written again, should a failover lose it


async def test_publish_returns_offsets_and_fills_the_frame(redis: RedisCluster) -> None:
    pub = Publisher(redis)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    assert await gen.meta({"message": "hi"}) == 1
    assert await gen.publish([Draft(kind="token", text="a"), Draft(kind="token", text="b")]) == [
        2,
        3,
    ]
    assert await gen.done({"tokens": 2}) == 4
    frames, first, last = await read_backlog(redis, sid, 0, 100)
    assert (first, last) == (1, 4)
    decoded = [decode(f) for f in frames]
    assert [f.offset for f in decoded] == [1, 2, 3, 4]
    assert [f.kind for f in decoded] == ["meta", "token", "token", "done"]
    assert all(f.epoch == gen.epoch and f.turn == gen.turn and f.session == sid for f in decoded)
    assert "".join(f.text for f in decoded) == "ab"
    ids = await redis.xrange(log_key(sid))
    assert ids is not None
    assert [i for i, _ in ids] == [b"1-1", b"2-1", b"3-1", b"4-1"]
    # the next generation continues the offsets
    gen2 = await pub.open_generation(sid)
    assert await gen2.token("c") == 5


async def test_publish_is_one_round_trip(redis: RedisCluster) -> None:
    pub = Publisher(redis)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    await gen.token("warm")  # loads the script on the node
    node = await _node_for(redis, meta_key(sid))
    try:
        await node.config_resetstat()
        await gen.publish([Draft(kind="token", text=str(i)) for i in range(20)])
        assert await _cmdstat(node, "evalsha") == 1
        assert await _cmdstat(node, "eval") == 0
        assert await _cmdstat(node, "xadd") == 20
        assert await _cmdstat(node, "spublish") == 20
    finally:
        await node.aclose()


async def test_stale_generation_is_fenced_and_writes_nothing(redis: RedisCluster) -> None:
    pub = Publisher(redis)
    sid = new_session_id()
    old = await pub.open_generation(sid)
    await old.token("x")
    new = await pub.open_generation(sid)
    with pytest.raises(Fenced) as info:
        await old.publish([Draft(kind="token", text="late")])
    assert info.value.current == new.epoch
    assert await redis.xlen(log_key(sid)) == 2  # "x", and the error frame that ended its turn
    assert await redis.hget(meta_key(sid), "offset") == b"2"
    assert await new.token("y") == 3


async def test_backlog_is_trimmed_and_keys_get_the_idle_ttl(redis: RedisCluster) -> None:
    pub = Publisher(redis, maxlen=10, ttl_s=300)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    for _ in range(30):
        await gen.publish([Draft(kind="token", text="t") for _ in range(20)])
    length = await redis.xlen(log_key(sid))
    assert length < 600
    frames, first, last = await read_backlog(redis, sid, 0, 1000)
    assert last == 600
    assert first > 1
    assert len(frames) == last - first + 1 == length
    assert decode(frames[0]).offset == first
    for k in (meta_key(sid), log_key(sid)):
        assert 0 < await redis.ttl(k) <= 300


async def test_the_ttl_is_set_again_once_it_ran_down_by_the_slack_not_every_frame(
    redis: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish script refreshes both keys' TTL only when more than min(60 s,
    ttl_s / 16) (here 300 s, so 18.75 s) went by on the producer's clock since it last
    set them (the hash's ``exp``), after a terminal frame, or when the clock is behind
    ``exp`` (another producer's); it runs no PTTL (nor any other read of a TTL)."""
    clock = [1_800_000_000_000]
    monkeypatch.setattr(publisher_mod, "now_ms", lambda: clock[0])
    pub = Publisher(redis, ttl_s=300)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    node = await _node_for(redis, meta_key(sid))
    try:
        await node.config_resetstat()
        await gen.token("a")  # the stream's first XADD: a key without a TTL, set at once
        assert await _cmdstat(node, "expire") == 2
        assert await redis.hget(meta_key(sid), "exp") == str(clock[0]).encode()
        for k in (meta_key(sid), log_key(sid)):
            assert 299_000 < await redis.pttl(k) <= 300_000
            await redis.pexpire(k, 299_500)  # (what a refresh would set back)

        async def token_after(ms: int, text: str) -> int:
            clock[0] += ms
            await node.config_resetstat()
            await gen.token(text)
            assert await _cmdstat(node, "pttl") == await _cmdstat(node, "ttl") == 0
            return await _cmdstat(node, "expire")

        assert await token_after(500, "b") == 0  # within the slack: left as it is
        for k in (meta_key(sid), log_key(sid)):
            assert await redis.pttl(k) <= 299_500
        assert await token_after(10_000, "c") == 0  # 10.5 s: still within the slack
        assert await token_after(9_000, "d") == 2  # 19.5 s: ran down by more, both set again
        for k in (meta_key(sid), log_key(sid)):
            assert 299_000 < await redis.pttl(k) <= 300_000
            await redis.pexpire(k, 295_000)
        assert await token_after(1_000, "e") == 0  # counted from the last refresh
        assert await token_after(-5_000, "f") == 2  # a clock behind it: set again at once
        assert await redis.hget(meta_key(sid), "exp") == str(clock[0]).encode()
        clock[0] += 500
        await node.config_resetstat()
        await gen.done({})  # within the slack, but the turn ends
        assert await _cmdstat(node, "expire") == 2
        for k in (meta_key(sid), log_key(sid)):
            assert 299_000 < await redis.pttl(k) <= 300_000
    finally:
        await node.aclose()


async def test_a_hash_the_script_restores_gets_its_ttl(redis: RedisCluster) -> None:
    """A failover lost the meta hash (not the backlog, whose TTL is fresh): the publish
    script restores the hash, and gives it the TTL and the lifetime field too."""
    pub = Publisher(redis, ttl_s=300)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    await gen.token("a")
    await redis.delete(meta_key(sid), log_key(sid))
    gen.offset = 0  # the restored hash has no offset: the script expects 0
    await redis.xadd(log_key(sid), {"f": "x"}, id="0-1")  # a backlog whose TTL is fresh
    await redis.expire(log_key(sid), 300)
    await gen.token("b")
    assert 299_000 < await redis.pttl(meta_key(sid)) <= 300_000
    assert await redis.hget(meta_key(sid), "ttl") == b"300"
    assert await redis.hget(meta_key(sid), "offset") == b"1"


async def test_read_backlog_pages_after_an_offset(redis: RedisCluster) -> None:
    pub = Publisher(redis)
    sid = new_session_id()
    gen = await pub.open_generation(sid)
    await gen.publish([Draft(kind="token", text=str(i)) for i in range(10)])
    frames, first, last = await read_backlog(redis, sid, 4, 3)
    assert [decode(f).offset for f in frames] == [5, 6, 7]
    assert (first, last) == (1, 10)
    frames, first, last = await read_backlog(redis, sid, 0, 0)
    assert (frames, first, last) == ([], 1, 10)
    frames, first, last = await read_backlog(redis, new_session_id(), 0, 10)
    assert (frames, first, last) == ([], 1, 0)


async def test_spublish_inside_the_script_reaches_a_shard_subscriber(redis: RedisCluster) -> None:
    """SPUBLISH from Lua works on this server (run on redis 7.0 and on valkey)."""
    pub = Publisher(redis)
    sid = new_session_id()
    node = await _node_for(redis, live_channel(sid))
    ps = node.pubsub()
    try:
        await ps.execute_command("SSUBSCRIBE", live_channel(sid))
        msg = await ps.parse_response(block=True, timeout=2)
        assert msg[0] == b"ssubscribe"
        gen = await pub.open_generation(sid)
        await gen.publish([Draft(kind="token", text="a"), Draft(kind="token", text="b")])
        got: list[Frame] = []
        async with asyncio.timeout(3):
            while len(got) < 2:
                m = await ps.parse_response(block=True, timeout=2)
                if m and m[0] == b"smessage":
                    got.append(decode(m[2]))
        assert [(f.offset, f.text) for f in got] == [(1, "a"), (2, "b")]
    finally:
        await ps.aclose()
        await node.aclose()
