"""The publisher after a failover that lost its last writes (asynchronous replication),
simulated on a real cluster by rolling the session's keys back by hand."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import OffsetConflict
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Publisher, read_backlog
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.protocol.frame import decode
from relay.protocol.keys import log_key, meta_key, new_session_id

pytestmark = pytest.mark.integration


async def _roll_back(redis: RedisCluster, sid: str, offset: int) -> None:
    """Make the session look as a replica that had only offsets 1..offset would."""
    entries = await redis.execute_command("XRANGE", log_key(sid), "-", f"{offset}-1")
    await redis.delete(log_key(sid))
    for entry_id, fields in entries:
        flat = [x for kv in dict(fields).items() for x in kv]
        await redis.execute_command("XADD", log_key(sid), entry_id, *flat)
    await redis.hset(meta_key(sid), "offset", offset)


async def test_frames_the_new_master_lacks_are_written_again_before_the_next(
    redis: RedisCluster,
) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.meta({"message": "hi"})
    for t in "abcd":
        await gen.token(t)
    before, _, _ = await read_backlog(redis, sid, 0, 10)
    # the promoted replica had only offsets 1..3
    await _roll_back(redis, sid, 3)
    assert await gen.token("e") == 6
    frames, first, last = await read_backlog(redis, sid, 0, 10)
    assert (first, last) == (1, 6)
    assert frames[:5] == before  # the same bytes at the same offsets
    assert "".join(decode(f).text for f in frames) == "abcde"
    assert gen.rewritten == 2


async def test_a_lost_open_generation_is_restored_not_fenced(redis: RedisCluster) -> None:
    sid = new_session_id()
    pub = Publisher(redis)
    await (await pub.open_generation(sid)).done()
    gen = await pub.open_generation(sid)
    await gen.token("a")
    # the promoted replica never saw the second open_generation
    await redis.hset(meta_key(sid), mapping={"epoch": gen.epoch - 1, "turn": gen.turn - 1})
    await redis.hdel(meta_key(sid), "open")
    assert await gen.token("b") == 3
    assert await redis.hget(meta_key(sid), "epoch") == str(gen.epoch).encode()
    assert await redis.hget(meta_key(sid), "open") == str(gen.turn).encode()


async def test_frames_of_another_generation_cannot_be_rewritten(redis: RedisCluster) -> None:
    sid = new_session_id()
    pub = Publisher(redis)
    g1 = await pub.open_generation(sid)
    await g1.token("a")
    await g1.done()
    g2 = await pub.open_generation(sid)
    await _roll_back(redis, sid, 1)  # g1's done frame is gone
    with pytest.raises(OffsetConflict):
        await g2.token("b")


async def test_offsets_a_relay_delivered_but_a_failover_lost_are_sealed_with_a_gap(
    redis: RedisCluster,
) -> None:
    hub = Hub(RedisBroker(redis, "sealer"), reap_interval_s=0)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        pub = Publisher(redis)
        gen = await pub.open_generation(sid)
        for t in "abcd":
            await gen.token(t)
        await gen.done()  # offsets 1..5, all delivered
        got: list[int] = []
        async with asyncio.timeout(5):
            while len(got) < 5:
                got.extend(d.offset for d in await w.next())
        await _roll_back(redis, sid, 3)  # the producer is gone: nobody rewrites 4, 5
        hub._on_resubscribed([sid])  # what a failover does to the hub
        async with asyncio.timeout(5):
            while (await read_backlog(redis, sid, 0, 0))[2] != 5:
                await asyncio.sleep(0.05)
        frames, _, _ = await read_backlog(redis, sid, 3, 10)
        gap = decode(frames[0])
        assert (gap.offset, gap.kind) == (5, "gap")
        assert gap.meta is not None
        assert (gap.meta["from"], gap.meta["to"]) == (4, 5)
        nxt = await pub.open_generation(sid)
        assert await nxt.token("e") == 6  # never reuses an offset a client holds
        async with asyncio.timeout(5):
            while got[-1] != 6:
                got.extend(d.offset for d in await w.next())
        assert got == [1, 2, 3, 4, 5, 6]
    finally:
        await hub.close()
