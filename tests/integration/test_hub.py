"""The hub against a real cluster: shared subscriptions, resume, slow consumers,
presence, and recovery after the relay's pubsub connection is killed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import WatchClosed
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Draft, Publisher
from relay.edge.conn.reader import Reader, open_reader
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.protocol.frame import Frame, decode, encode
from relay.protocol.keys import live_channel, log_key, meta_key, new_session_id, presence_key

pytestmark = pytest.mark.integration


@pytest.fixture
async def hub(redis: RedisCluster) -> AsyncIterator[Hub]:
    h = Hub(
        RedisBroker(redis, f"test-{new_session_id()[:8]}"),
        unsubscribe_delay_s=0.3,
        reap_interval_s=0,
    )
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def collect(
    watch: Reader, until: int, within_s: float = 10.0, hub: Hub | None = None
) -> list[Delivery]:
    """Read deliveries until one has an offset >= until."""
    out: list[Delivery] = []
    try:
        async with asyncio.timeout(within_s):
            while not out or out[-1].offset < until:
                out.extend(await watch.next())
    except TimeoutError:  # say what the hub saw, for a failure that does not reproduce
        stats = hub.stats() if hub is not None else {}
        raise AssertionError(f"offsets {token_offsets(out)}, not {until}: {stats}") from None
    return out


def token_offsets(ds: list[Delivery]) -> list[int]:
    return [d.offset for d in ds]


def covered(ds: list[Delivery]) -> list[int]:
    """Offsets delivered, merged token frames expanded to the range they replace."""
    out: list[int] = []
    for d in ds:
        meta = decode(d.data).meta or {}
        start = int(meta["from"]) if "merged" in meta else d.offset
        out.extend(range(start, d.offset + 1))
    return out


async def _node_clients(redis: RedisCluster, key: str) -> aioredis.Redis:
    node = redis.get_node_from_key(key)
    assert node is not None
    return aioredis.Redis(host=node.host, port=int(node.port))


async def _sub_clients(redis: RedisCluster, relay_id: str) -> list[tuple[aioredis.Redis, str]]:
    """(node client, CLIENT LIST line) for every tokenrelay-sub connection of relay_id."""
    found = []
    for node in redis.get_nodes():
        c = aioredis.Redis(host=node.host, port=int(node.port))
        for line in (await c.execute_command("CLIENT", "LIST")).decode().splitlines():
            if f"name=tokenrelay-sub:{relay_id} " in line + " ":
                found.append((c, line))
    return found


async def test_many_watchers_of_one_session_share_one_subscription(
    hub: Hub, redis: RedisCluster
) -> None:
    sid = new_session_id()
    watches = await asyncio.gather(*(open_reader(hub, sid, None) for _ in range(20)))
    assert hub.stats()["subscribes"] == 1
    assert sum(hub.stats()["channels_per_node"].values()) == 1
    node = await _node_clients(redis, live_channel(sid))
    try:
        numsub = await node.execute_command("PUBSUB", "SHARDNUMSUB", live_channel(sid))
        assert numsub[1] == 1
    finally:
        await node.aclose()
    gen = await Publisher(redis).open_generation(sid)
    await gen.publish([Draft(kind="token", text="a"), Draft(kind="token", text="b")])
    for w in watches:
        got = await collect(w, 2)
        assert token_offsets(got) == [1, 2]
        assert got[0].data == (await collect_bytes(redis, sid))[0]
    assert hub.stats()["watches"] == 20


async def collect_bytes(redis: RedisCluster, sid: str) -> list[bytes]:
    from relay.broker.rediscluster.publisher import read_backlog

    frames, _, _ = await read_backlog(redis, sid, 0, 100_000)
    return frames


async def test_resume_from_offset_gives_the_rest_then_live_under_concurrent_publish(
    hub: Hub, redis: RedisCluster
) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.publish([Draft(kind="token", text=f"{i} ") for i in range(50)])
    stop = asyncio.Event()

    async def produce() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            await gen.publish([Draft(kind="token", text=f"x{i} ") for _ in range(3)])
            i += 1
            await asyncio.sleep(0)

    producer = asyncio.create_task(produce())
    watchers = [await open_reader(hub, sid, n) for n in (0, 7, 30, 49)]
    await producer
    stop.set()
    last = gen.offset
    for n, w in zip((0, 7, 30, 49), watchers, strict=True):
        got = await collect(w, last)  # nobody read while producing: merged frames
        assert covered(got) == list(range(n + 1, last + 1)), f"from {n}"
        assert all(d.kind == "token" for d in got)
        texts = [decode(f).text for f in await collect_bytes(redis, sid)]
        assert "".join(decode(d.data).text for d in got) == "".join(texts[n:])


async def test_live_only_watch_starts_at_the_current_end(hub: Hub, redis: RedisCluster) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.publish([Draft(kind="token", text="old")] * 5)
    w = await open_reader(hub, sid, None)
    await gen.token("new")
    got = await collect(w, 6)
    assert token_offsets(got) == [6]


async def test_offset_older_than_backlog_gives_gap_frame(hub: Hub, redis: RedisCluster) -> None:
    sid = new_session_id()
    gen = await Publisher(redis, maxlen=5).open_generation(sid)
    for _ in range(10):
        await gen.publish([Draft(kind="token", text="t")] * 50)
    w = await open_reader(hub, sid, 0)
    got = await collect(w, 500)
    assert got[0].kind == "gap"
    gap = json.loads(got[0].data)
    assert gap["meta"]["from"] == 1
    first = gap["meta"]["to"] + 1
    assert token_offsets(got[1:]) == list(range(first, 501))
    assert hub.stats()["gaps"] >= 1


async def test_slow_watcher_gets_merged_frames_then_is_closed_fast_one_unaffected(
    redis: RedisCluster,
) -> None:
    hub = Hub(
        RedisBroker(redis, "slow-test"), queue_frames=20, hard_limit_frames=60, reap_interval_s=0
    )
    await hub.start()
    try:
        sid = new_session_id()
        slow = await open_reader(hub, sid, None)
        fast = await open_reader(hub, sid, None)
        gen = await Publisher(redis).open_generation(sid)
        texts = [f"w{i} " for i in range(200)]
        fast_reader = asyncio.create_task(collect(fast, 200))
        for chunk in range(0, 200, 10):
            await gen.publish([Draft(kind="token", text=t) for t in texts[chunk : chunk + 10]])
            await asyncio.sleep(0.005)  # the fast watcher reads as it goes
        fast_got = await fast_reader
        slow_got = await collect(slow, 200)
        assert token_offsets(fast_got) == list(range(1, 201))
        assert len(slow_got) < 200
        assert hub.stats()["conflations"] >= 1
        assert "".join(decode(d.data).text for d in slow_got) == "".join(texts)
        offs = token_offsets(slow_got)
        assert offs == sorted(offs)
        assert covered(slow_got) == list(range(1, 201))
        # now frames that cannot merge (one per turn) push the slow watcher past the limit
        fast_reader = asyncio.create_task(collect(fast, 270))
        for _ in range(70):
            await gen.meta({"n": 1})
        assert token_offsets(await fast_reader) == list(range(201, 271))
        async with asyncio.timeout(5):
            with pytest.raises(WatchClosed) as info:
                await slow.next()
        assert info.value.code == "slow_consumer"
        assert hub.stats()["slow_disconnects"] == 1
        await gen.token("after")
        assert token_offsets(await collect(fast, gen.offset)) == [gen.offset]
    finally:
        await hub.close()


async def test_last_watcher_leaving_unsubscribes_after_the_delay(
    hub: Hub, redis: RedisCluster
) -> None:
    sid = new_session_id()
    w1 = await open_reader(hub, sid, None)
    w2 = await open_reader(hub, sid, None)
    await w1.close()
    await w2.close()
    assert hub.stats()["channels"] == 1  # still subscribed during the delay
    # a watcher coming back within the delay reuses the subscription
    w3 = await open_reader(hub, sid, None)
    await asyncio.sleep(0.5)
    assert hub.stats()["subscribes"] == 1
    await w3.close()
    await asyncio.sleep(0.6)
    assert hub.stats()["channels"] == 0
    node = await _node_clients(redis, live_channel(sid))
    try:
        numsub = await node.execute_command("PUBSUB", "SHARDNUMSUB", live_channel(sid))
        assert numsub[1] == 0
    finally:
        await node.aclose()
    with pytest.raises(WatchClosed):
        await w3.next()


async def test_presence_is_refreshed_while_watched_and_removed_after(
    redis: RedisCluster,
) -> None:
    hub = Hub(RedisBroker(redis, "presence-ttl", presence_ttl_s=1.5), reap_interval_s=0)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, None)
        await asyncio.sleep(0.3)
        score = await redis.zscore(presence_key(sid), hub.relay_id)
        assert score is not None  # the entry's expiry, in Redis server ms
        server_ms = await _server_ms(redis, sid)
        assert server_ms < score <= server_ms + 1_500
        assert 0 < await redis.pttl(presence_key(sid)) <= 1_500
        await asyncio.sleep(1.2)  # refreshed every third of the TTL
        later = await redis.zscore(presence_key(sid), hub.relay_id)
        assert later is not None
        assert later > score
        assert later > await _server_ms(redis, sid)  # never lapses while watched
        await w.close()
        await asyncio.sleep(0.3)
        assert await redis.zscore(presence_key(sid), hub.relay_id) is None
    finally:
        await hub.close()


async def _server_ms(redis: RedisCluster, sid: str) -> int:
    """TIME of the node that holds the session's slot, in ms."""
    lua = "local t = redis.call('TIME') return t[1] * 1000 + math.floor(t[2] / 1000)"
    return int(await redis.eval(lua, 1, presence_key(sid)))


async def test_opening_many_watches_writes_each_session_once_not_all_each_time(
    redis: RedisCluster,
) -> None:
    # a long interval: only the writes for new sessions happen during the test
    hub = Hub(RedisBroker(redis, "presence-n", presence_ttl_s=180.0), reap_interval_s=0)
    await hub.start()
    try:
        await asyncio.sleep(0.1)  # the first (empty) full refresh is done
        sids = [new_session_id() for _ in range(120)]
        watches = [await open_reader(hub, sid, None) for sid in sids]
        await asyncio.sleep(0.3)
        writes = hub.stats()["presence_writes"]
        assert len(sids) <= writes <= len(sids) + 5  # O(n), not a full refresh per watch
        for sid in sids[:3]:
            assert await redis.zscore(presence_key(sid), hub.relay_id) is not None
        second = await open_reader(hub, sids[0], None)  # not a new session: no write
        await asyncio.sleep(0.2)
        assert hub.stats()["presence_writes"] == writes
        for w in [*watches, second]:
            await w.close()
    finally:
        await hub.close()


async def test_killed_pubsub_connection_is_repaired_from_the_backlog(
    hub: Hub, redis: RedisCluster
) -> None:
    sid = new_session_id()
    w = await open_reader(hub, sid, 0)
    gen = await Publisher(redis).open_generation(sid)
    await gen.publish([Draft(kind="token", text="a")] * 5)
    assert token_offsets(await collect(w, 5)) == [1, 2, 3, 4, 5]
    conns = await _sub_clients(redis, hub.relay_id)
    assert conns, "the relay's pubsub connections are named"
    try:
        for client, line in conns:
            cid = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)["id"]
            await client.execute_command("CLIENT", "KILL", "ID", cid)
        # published while the relay is reconnecting: only the backlog has these
        await gen.publish([Draft(kind="token", text="b")] * 5)
        got = await collect(w, 10)
        assert token_offsets(got) == [6, 7, 8, 9, 10]
        await gen.publish([Draft(kind="token", text="c")] * 2)
        assert token_offsets(await collect(w, 12)) == [11, 12]
        assert hub.stats()["subscriber"]["connections_lost"] >= 1
        assert hub.stats()["resubscribes"] >= 1
    finally:
        for client, _ in conns:
            await client.aclose()


async def test_watch_can_read_from_replicas(cluster, redis: RedisCluster) -> None:
    broker = RedisBroker(redis, "replica-reader", read_from_replicas=True)
    hub = Hub(broker, reap_interval_s=0)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        assert broker.subscriber is not None
        addr = broker.subscriber.node_of(live_channel(sid))
        assert addr is not None
        assert addr.port in {n.port for n in cluster.replicas}
        gen = await Publisher(redis).open_generation(sid)
        await gen.publish([Draft(kind="token", text="r")] * 3)
        assert token_offsets(await collect(w, 3)) == [1, 2, 3]
    finally:
        await hub.close()


@pytest.mark.slow
async def test_failover_resubscribes_on_the_new_master_and_repairs(private_cluster) -> None:
    """CLUSTER FAILOVER pushes an unsolicited sunsubscribe; nothing is lost or duplicated."""
    local = await private_cluster(masters=3, replicas=1)
    info = local.info
    host, port = info.startup_nodes[0]
    redis = RedisCluster(host=host, port=port)
    await redis.initialize()
    broker = RedisBroker(redis, "failover-test")
    hub = Hub(broker, reap_interval_s=0)  # no turn lock: no reaper
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        pub = Publisher(redis)
        gen = await pub.open_generation(sid)
        await gen.publish([Draft(kind="token", text="a")] * 5)
        assert token_offsets(await collect(w, 5)) == [1, 2, 3, 4, 5]
        owner = redis.get_node_from_key(live_channel(sid))
        assert owner is not None
        replica = next(n for n in info.replicas if n.master_port == owner.port)
        rc = aioredis.Redis(host=replica.host, port=replica.port)
        try:
            await rc.execute_command("CLUSTER", "FAILOVER")
            async with asyncio.timeout(20):
                while (await rc.info("replication"))["role"] != "master":
                    await asyncio.sleep(0.1)
        finally:
            await rc.aclose()
        async with asyncio.timeout(20):  # publish through the failover; retry MOVED/down
            while True:
                try:
                    await gen.publish([Draft(kind="token", text="b")] * 5)
                    break
                except Exception:
                    await asyncio.sleep(0.2)
        got = await collect(w, 10, within_s=20)
        assert token_offsets(got) == [6, 7, 8, 9, 10]
        async with asyncio.timeout(10):
            while broker.subscriber is not None and broker.subscriber.node_of(
                live_channel(sid)
            ) != (replica.host, replica.port):
                await asyncio.sleep(0.1)
        assert hub.stats()["resubscribes"] >= 1
        await gen.publish([Draft(kind="token", text="c")] * 2)
        assert token_offsets(await collect(w, 12)) == [11, 12]
    finally:
        await hub.close()
        await redis.aclose()


async def test_lost_pubsub_message_is_repaired_from_the_backlog_once_per_channel(
    hub: Hub, redis: RedisCluster
) -> None:
    sid = new_session_id()
    watches = [await open_reader(hub, sid, None) for _ in range(5)]
    gen = await Publisher(redis).open_generation(sid)
    await gen.token("a")
    for w in watches:
        assert token_offsets(await collect(w, 1)) == [1]
    # offset 2 reaches the backlog but its live message is "lost" (never SPUBLISHed)
    lost = Frame(session=sid, turn=gen.turn, offset=2, kind="token", text="b", epoch=gen.epoch)
    await redis.xadd(log_key(sid), {"f": encode(lost)}, id="2-1")
    await redis.hset(meta_key(sid), "offset", 2)
    gen.offset = 2
    repairs = hub.stats()["repairs"]
    await gen.token("c")
    for w in watches:
        got = await collect(w, 3)
        assert token_offsets(got) == [2, 3]
        assert [decode(d.data).text for d in got] == ["b", "c"]
    assert hub.stats()["repairs"] == repairs + 1  # one backlog read for all five watchers
