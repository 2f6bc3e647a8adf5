"""The relays' heartbeats (relay.broker.rediscluster.relays) on the real cluster, and what
a relay does with what they tell.

1. A relay whose beats stop is reported dead to the others, once, within the beat TTL
   and a beat; when it beats again it learns that it lapsed, and is no longer dead.
2. A relay that stops cleanly leaves the set: it is never reported dead.
3. The refresh with a dead relay's id removes its entry and its screen count and sends
   the corrected total, at once (not after the dead relay's entry expired).
4. A recount writes every count this relay wrote again, even an unchanged one (the
   others dropped it while this relay was taken for dead).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.memory import MemoryBroker
from relay.broker.rediscluster.presence import Presence, write_screens
from relay.broker.rediscluster.relays import Heartbeats
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.protocol.keys import RELAYS_REGISTRY, new_session_id, presence_key, screens_key

pytestmark = pytest.mark.integration


class Told:
    def __init__(self) -> None:
        self.dead: list[list[str]] = []  # the ids of each call
        self.lapses = 0

    def on_dead(self, dead: Mapping[str, int]) -> None:
        assert all(at <= time.time() * 1000 + 1000 for at in dead.values())  # expired
        self.dead.append(sorted(dead))

    def on_lapsed(self) -> None:
        self.lapses += 1


def beats(redis: RedisCluster, rid: str, told: Told) -> Heartbeats:
    return Heartbeats(
        redis, rid, on_dead=told.on_dead, on_lapsed=told.on_lapsed, beat_s=0.1, ttl_s=0.5
    )


async def test_a_relay_whose_beats_stop_is_reported_dead_once_and_lapses_when_back(
    redis: RedisCluster,
) -> None:
    tag = new_session_id()
    a_told, b_told = Told(), Told()
    a, b = beats(redis, f"a-{tag}", a_told), beats(redis, f"b-{tag}", b_told)
    try:
        await a.beat()
        await b.beat()
        assert not [ids for ids in b_told.dead if f"a-{tag}" in ids]  # other tests' may be
        assert a_told.lapses == 0
        await asyncio.sleep(0.7)  # a is silent longer than its beats' TTL
        await b.beat()
        await b.beat()
        assert [ids for ids in b_told.dead if f"a-{tag}" in ids] == [[f"a-{tag}"]]  # once
        await a.beat()  # a was only stalled
        assert a_told.lapses == 1
        await b.beat()
        assert f"a-{tag}" not in b.dead
        await b.close()  # b stops cleanly: it leaves the set
        assert await redis.zscore(RELAYS_REGISTRY, f"b-{tag}") is None
        await asyncio.sleep(0.7)
        await a.beat()
        assert f"b-{tag}" not in a.dead
    finally:
        await a.close()
        await b.close()


async def test_a_refresh_with_a_dead_relays_id_corrects_the_count_at_once(
    redis: RedisCluster,
) -> None:
    sid = new_session_id()
    # the dead relay's entry was written before it went silent (it expires in 20 s,
    # not 30): a relay back under the same id, writing now, keeps its own (below)
    assert await write_screens(redis, [(sid, 2)], "dead-relay", ttl_s=20) == [2]
    assert await write_screens(redis, [(sid, 3)], "live-relay", ttl_s=30) == [5]
    live = Presence(redis, "live-relay", ttl_s=30)
    live.add(sid)
    silent_at = int(time.time() * 1000) - 1000  # its heartbeat expired a second ago
    live.drop_dead({"dead-relay": silent_at}, 5.0)
    await live._flush(time.monotonic())
    assert await redis.zscore(presence_key(sid), "dead-relay") is None
    assert await redis.hgetall(screens_key(sid)) == {b"live-relay": b"3"}
    # the next write counts three: the dead relay's two are gone, not expiring in 20 s
    assert await write_screens(redis, [(sid, 3)], "live-relay", ttl_s=30) == [3]
    # the same id back and writing now: a write naming it dead leaves its fresh entry
    assert await write_screens(redis, [(sid, 1)], "dead-relay", ttl_s=30) == [4]
    got = await write_screens(
        redis, [(sid, 3)], "live-relay", ttl_s=30, dead={"dead-relay": silent_at}, silent_s=5.0
    )
    assert got == [4]
    # and an old one goes on a screens write too
    other = new_session_id()
    assert await write_screens(redis, [(other, 2)], "dead-relay", ttl_s=20) == [2]
    got = await write_screens(
        redis,
        [(other, 1)],
        "live-relay",
        ttl_s=30,
        dead={"dead-relay": silent_at},
        silent_s=5.0,
    )
    assert got == [1]


async def test_a_recount_writes_every_count_again_even_unchanged() -> None:
    broker = MemoryBroker("recount")
    hub = Hub(broker, reap_interval_s=0, screens_interval_s=0.1)
    await hub.start()
    try:
        screen = await open_reader(hub, "watched", None)
        async with asyncio.timeout(5):
            while broker.screen_writes < 1:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert broker.screen_writes == 1  # an unchanged count is not written again ...
        hub.screens.recount()
        async with asyncio.timeout(5):
            while broker.screen_writes < 2:  # ... but a recount writes it
                await asyncio.sleep(0.02)
        assert broker.screen_counts["watched"] == {"recount": 1}
        await screen.close()
    finally:
        await hub.close()
