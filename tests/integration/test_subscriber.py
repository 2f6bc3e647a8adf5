"""The per-node sharded subscriber against a real cluster: batching, MOVED, races."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import SubscribeError
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.keys import live_channel, new_session_id
from relay.protocol.slotmap import SLOTS, SlotMap, group_by_slot, parse_shards, slot_of
from tests.conftest import PrivateClusterFactory

pytestmark = pytest.mark.integration


class Inbox:
    def __init__(self) -> None:
        self.got: list[tuple[bytes, bytes]] = []
        self.resubscribed: list[str] = []
        self.event = asyncio.Event()

    def on_message(self, msgs: list[list[bytes]]) -> None:
        self.got.extend((channel, data) for _, channel, data in msgs)
        self.event.set()

    def on_resubscribed(self, channels: list[str]) -> None:
        self.resubscribed.extend(channels)

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(5):
            while len(self.got) < n:
                self.event.clear()
                await self.event.wait()


async def _sub(redis: RedisCluster, inbox: Inbox) -> ShardedSubscriber:
    sub = ShardedSubscriber(
        redis,
        on_message=inbox.on_message,
        on_resubscribed=inbox.on_resubscribed,
        relay_id=f"t-{new_session_id()[:6]}",
    )
    await sub.start()
    return sub


async def _numsub(redis: RedisCluster, channel: str) -> int:
    node = redis.get_node_from_key(channel)
    assert node is not None
    c = aioredis.Redis(host=node.host, port=int(node.port))
    try:
        return int((await c.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1])
    finally:
        await c.aclose()


async def test_many_channels_subscribe_with_one_ssubscribe_per_slot(redis: RedisCluster) -> None:
    inbox = Inbox()
    sub = await _sub(redis, inbox)
    try:
        # channels of the same session id prefix-free; force some to share a slot
        chans = [live_channel(new_session_id()) for _ in range(150)]
        await sub.subscribe(chans)
        assert sub.stats["ssubscribe_commands"] == len(group_by_slot(chans))
        assert sum(sub.channels_per_node().values()) == 150
        assert len(sub.channels_per_node()) == 3  # one connection per master
        for c in chans[:30]:
            await redis.spublish(c, b"hi")
        await inbox.wait_for(30)
        assert {ch.decode() for ch, _ in inbox.got} == set(chans[:30])
    finally:
        await sub.close()


async def test_moved_reply_refreshes_the_slot_map_and_subscribes_on_the_owner(
    redis: RedisCluster,
) -> None:
    inbox = Inbox()
    sub = await _sub(redis, inbox)
    try:
        assert sub._map is not None
        real = sub._map
        wrong = SlotMap([real.slots[(s + SLOTS // 2) % SLOTS] for s in range(SLOTS)])
        sub._map = wrong  # every channel now goes to a node that answers -MOVED
        ch = live_channel(new_session_id())
        await sub.subscribe([ch])
        assert sub.stats["map_refreshes"] >= 2
        assert sub.node_of(ch) == real.node_for(next(iter(group_by_slot([ch]))))
        await redis.spublish(ch, b"x")
        await inbox.wait_for(1)
    finally:
        await sub.close()


async def test_unsubscribe_then_subscribe_again_ends_subscribed(redis: RedisCluster) -> None:
    inbox = Inbox()
    sub = await _sub(redis, inbox)
    try:
        ch = live_channel(new_session_id())
        await sub.subscribe([ch])
        sub.unsubscribe([ch])
        await sub.subscribe([ch])  # SUNSUBSCRIBE and SSUBSCRIBE in flight on one connection
        await asyncio.sleep(0.1)
        assert await _numsub(redis, ch) == 1
        assert inbox.resubscribed == []  # a fresh subscribe is not a re-subscribe
        await redis.spublish(ch, b"x")
        await inbox.wait_for(1)
        sub.unsubscribe([ch])
        await asyncio.sleep(0.1)
        assert await _numsub(redis, ch) == 0
    finally:
        await sub.close()


async def test_timed_out_subscribes_leave_no_waiters(redis: RedisCluster) -> None:
    """A subscribe that times out forgets its waiters: many sessions, no growth."""
    sub = ShardedSubscriber(
        redis,
        on_message=lambda msgs: None,
        on_resubscribed=lambda cs: None,
        relay_id="waiters",
        subscribe_timeout_s=0.0,
    )
    await sub.start()
    try:
        for _ in range(50):
            with pytest.raises(SubscribeError):
                await sub.subscribe([live_channel(new_session_id())])
        assert sub._waiters == {}
    finally:
        await sub.close()


@pytest.mark.slow
async def test_a_lagging_slot_map_after_failover_is_refreshed_until_it_catches_up(
    private_cluster,
) -> None:
    """After CLUSTER FAILOVER the old master unsubscribes us. The first maps fetched
    here are the pre-failover map (a node that has not heard yet): the subscriber must
    not settle on the demoted master it names, but refresh until the map names the new
    master, subscribe there, and get what is published there."""
    local = await private_cluster(masters=3, replicas=1)
    info = local.info
    host, port = info.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    await redis.initialize()
    inbox = Inbox()
    sub = await _sub(redis, inbox)
    try:
        ch = live_channel(new_session_id())
        await sub.subscribe([ch])
        old = sub.node_of(ch)
        assert old is not None
        replica = next(n for n in info.replicas if n.master_port == old.port)
        stale = sub._map
        real_refresh = sub._refresh_map
        served_stale = 0

        async def lagging_refresh() -> None:
            nonlocal served_stale
            if served_stale < 3:  # the next three maps come from a node that lags
                served_stale += 1
                sub._map, sub._stale = stale, False
                return
            await real_refresh()

        sub._refresh_map = lagging_refresh  # type: ignore[method-assign]
        rc = aioredis.Redis(host=replica.host, port=replica.port)
        try:
            await rc.execute_command("CLUSTER", "FAILOVER")
            async with asyncio.timeout(20):
                while sub.node_of(ch) != (replica.host, replica.port):
                    await asyncio.sleep(0.05)
            assert served_stale == 3
            assert sub.stats["stale_maps"] >= 1
            await rc.execute_command("SPUBLISH", ch, b"on the new master")
        finally:
            await rc.aclose()
        await inbox.wait_for(1)
        assert inbox.got[-1] == (ch.encode(), b"on the new master")
    finally:
        await sub.close()
        await redis.aclose()


@pytest.mark.slow
async def test_a_master_lost_without_replica_does_not_stop_subscribing_on_the_other_shards(
    private_cluster: PrivateClusterFactory,
) -> None:
    """Once the cluster marks a dead master failed, no node gives a whole slot map (its
    slots have no master). The subscriber used to refuse every map then, so a new viewer
    of a session on a healthy shard could not be subscribed until the dead node came
    back. It now works from the most complete map; the dead shard's channels wait."""
    local = await private_cluster(masters=3, replicas=0)
    assert local.info is not None
    host, port = local.info.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    await redis.initialize()
    inbox = Inbox()
    sub = await _sub(redis, inbox)
    sub.subscribe_timeout_s = 2
    try:
        channels = [live_channel(new_session_id()) for _ in range(60)]
        masters = await local.masters_now()
        dead = next(iter(masters))
        on_dead = [c for c in channels if slot_of(c) in masters[dead]]
        alive = [c for c in channels if slot_of(c) not in masters[dead]]
        local.kill_node(dead)
        live = aioredis.Redis(host=host, port=next(p for p in masters if p != dead))
        try:
            async with asyncio.timeout(20):  # until the cluster marks it failed
                while parse_shards(await live.execute_command("CLUSTER", "SHARDS")).complete():
                    await asyncio.sleep(0.1)
            with pytest.raises(SubscribeError):  # the dead shard: no confirmation
                await sub.subscribe(on_dead[:1])
            await sub.subscribe(alive[:1])  # a healthy shard: subscribed all the same
            node = redis.get_node_from_key(alive[0])
            assert node is not None
            pub = aioredis.Redis(host=node.host, port=int(node.port))
            try:
                await pub.execute_command("SPUBLISH", alive[0], b"still here")
            finally:
                await pub.aclose()
            await inbox.wait_for(1)
            assert inbox.got[-1] == (alive[0].encode(), b"still here")
        finally:
            await live.aclose()
    finally:
        await sub.close()
        await redis.aclose()
