"""Watching keeps a session alive: a relay's presence refresh extends the session's keys
by the lifetime its producer stored (``ttl`` in the meta hash), never shortening them
and never bringing an expired session back; without a viewer the keys expire as
before. Real cluster, a real hub (docs/PROTOCOL.md, "Redis: keys, channels and hash
tags")."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Publisher
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.protocol.keys import KeyKind, hist_key, key, log_key, meta_key, new_session_id

pytestmark = pytest.mark.integration

TTL_S = 2  # the session's lifetime, as its producer chose it
PRESENCE_TTL_S = 1.5  # the hub refreshes its entries (and the session's keys) every ~0.5 s


def session_keys(sid: str) -> list[str]:
    return [meta_key(sid), log_key(sid), hist_key(sid), key(sid, KeyKind.HIST, "state")]


async def start(redis: RedisCluster, sid: str) -> None:
    """One turn through the publisher, and the history a worker writes beside it, all
    expiring ``TTL_S`` after this write."""
    gen = await Publisher(redis, ttl_s=TTL_S).open_generation(sid)
    await gen.token("hi")
    await gen.done()
    await redis.rpush(hist_key(sid), "m")
    await redis.hset(key(sid, KeyKind.HIST, "state"), "engine", "e")
    for k in session_keys(sid)[2:]:
        await redis.expire(k, TTL_S)


async def alive(redis: RedisCluster, sid: str) -> list[int]:
    """The remaining lifetime (ms) of each of the session's keys (-2: gone)."""
    return [int(await redis.pttl(k)) for k in session_keys(sid)]


async def gone(redis: RedisCluster, sid: str) -> None:
    async with asyncio.timeout(15):
        while any(t != -2 for t in await alive(redis, sid)):
            await asyncio.sleep(0.1)


async def test_the_producer_stores_the_session_lifetime_in_its_meta_hash(
    redis: RedisCluster,
) -> None:
    sid = new_session_id()
    gen = await Publisher(redis, ttl_s=TTL_S).open_generation(sid)
    assert await redis.hget(meta_key(sid), "ttl") == str(TTL_S).encode()
    await redis.hdel(meta_key(sid), "ttl")  # as after a failover that lost the open
    await gen.token("x")
    assert await redis.hget(meta_key(sid), "ttl") == str(TTL_S).encode()


async def test_a_watched_session_outlives_its_ttl_and_expires_once_nobody_watches(
    redis: RedisCluster,
) -> None:
    watched, idle, expired = new_session_id(), new_session_id(), new_session_id()
    hub = Hub(RedisBroker(redis, "ttl-test", presence_ttl_s=PRESENCE_TTL_S), reap_interval_s=0)
    await hub.start()
    try:
        for sid in (watched, idle, expired):
            await start(redis, sid)
        await redis.delete(*session_keys(expired))  # its keys expired before anyone watched
        w = await open_reader(hub, watched, 0)
        w_expired = await open_reader(hub, expired, 0)
        await gone(redis, idle)  # nobody watches it: gone TTL_S after its last write
        await asyncio.sleep(TTL_S + 0.5)  # another whole lifetime, without a write
        remaining = await alive(redis, watched)
        assert all(0 < t <= TTL_S * 1000 for t in remaining), remaining
        assert await alive(redis, expired) == [-2] * 4  # watching brings nothing back
        await w.close()  # the last viewer leaves: the refreshes stop
        await w_expired.close()
        await gone(redis, watched)
    finally:
        await hub.close()


async def test_a_longer_lifetime_is_never_shortened_and_a_persistent_key_stays_so(
    redis: RedisCluster,
) -> None:
    sid = new_session_id()
    hub = Hub(RedisBroker(redis, "ttl-test-2", presence_ttl_s=PRESENCE_TTL_S), reap_interval_s=0)
    await hub.start()
    try:
        await start(redis, sid)
        await redis.expire(log_key(sid), 600)  # longer than the session's lifetime
        await redis.persist(hist_key(sid))  # an operator made it persistent
        w = await open_reader(hub, sid, 0)
        await asyncio.sleep(TTL_S + 0.5)
        meta, log, hist, state = await alive(redis, sid)
        assert 0 < meta <= TTL_S * 1000
        assert 0 < state <= TTL_S * 1000
        assert log > TTL_S * 1000
        assert hist == -1
        await w.close()
    finally:
        await hub.close()
        await redis.delete(*session_keys(sid))
