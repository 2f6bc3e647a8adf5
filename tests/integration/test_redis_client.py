"""The gated cluster client: a burst waits for connections instead of failing."""

from __future__ import annotations

import asyncio

import pytest
from redis import __version__ as redis_py_version
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.connect import GatedRedisCluster, connect
from tests.conftest import PrivateClusterFactory

pytestmark = pytest.mark.integration

BURST = 300


async def _burst(client: RedisCluster) -> list[object]:
    async def one(i: int) -> object:
        # a Lua script that takes a moment, so that the burst overlaps
        return await client.execute_command(
            "EVAL", "for i = 1, 20000 do end return ARGV[1]", 1, f"k{i}", str(i)
        )

    return await asyncio.gather(*(one(i) for i in range(BURST)), return_exceptions=True)


async def test_plain_redis_py_fails_a_burst_at_its_pool_limit(cluster: ClusterInfo) -> None:
    """The behaviour the gate exists for: redis-py raises instead of waiting."""
    client = RedisCluster.from_url(cluster.url, max_connections=4)
    try:
        await client.initialize()
        results = await _burst(client)
    finally:
        await client.aclose()
    assert any(isinstance(r, MaxConnectionsError) for r in results)


async def test_the_gated_client_serves_the_same_burst_within_its_bound(
    cluster: ClusterInfo,
) -> None:
    client = connect(cluster.url, concurrency=4)
    try:
        await client.initialize()
        results = await _burst(client)
        assert results == [str(i).encode() for i in range(BURST)]
        for node in client.get_nodes():
            assert len(node._connections) <= 4, node.name
        assert client.waiting == 0
    finally:
        await client.aclose()


async def test_pipelines_over_every_node_are_gated_too(cluster: ClusterInfo) -> None:
    client = connect(cluster.url, concurrency=2)
    try:
        await client.initialize()

        async def pipe(i: int) -> list[object]:
            p = client.pipeline(transaction=False)
            for k in range(12):  # keys in slots of every master
                p.set(f"pipe:{i}:{k}", i)
            for k in range(12):
                p.get(f"pipe:{i}:{k}")
            return list(await p.execute())

        results = await asyncio.gather(*(pipe(i) for i in range(100)))
        assert all(r[12:] == [str(i).encode()] * 12 for i, r in enumerate(results))
        for node in client.get_nodes():
            assert len(node._connections) <= 2, node.name
    finally:
        await client.aclose()


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        GatedRedisCluster(host="127.0.0.1", port=1, concurrency=0)
    with pytest.raises(ValueError, match="max_connections"):
        GatedRedisCluster(host="127.0.0.1", port=1, concurrency=8, max_connections=4)


async def test_waiters_are_counted_and_a_cancelled_waiter_leaves_no_trace(
    cluster: ClusterInfo,
) -> None:
    client = connect(cluster.url, concurrency=1)
    try:
        await client.initialize()
        slow = "for i = 1, 3000000 do end return 1"  # ~0.1 s of server time
        tasks = [asyncio.create_task(client.execute_command("EVAL", slow, 0)) for _ in range(3)]
        async with asyncio.timeout(10):
            while client.waiting < 2:
                await asyncio.sleep(0.005)
        tasks[2].cancel()  # a waiter gives up
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[:2] == [1, 1]
        assert isinstance(results[2], asyncio.CancelledError)
        assert client.waiting == 0
        assert await client.execute_command("PING")  # the permit was not leaked
    finally:
        await client.aclose()


_REDIS_PY = tuple(int(p) for p in redis_py_version.split(".")[:2])


async def _pipeline(client: RedisCluster, *commands: tuple[str | int, ...]) -> list[object]:
    async with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        result: list[object] = await pipe.execute()
        return result


@pytest.mark.timeout(120)
async def test_a_dead_default_node_does_not_fail_commands_on_the_live_shards(
    private_cluster: PrivateClusterFactory,
) -> None:
    """redis-py sends ``COMMAND`` to its default node at every re-initialization; with
    that node dead (its slots still listed, no replica to take over) every command of
    the client failed, on every shard. Plain redis-py shows the failure; ours does not."""
    local = await private_cluster(masters=3, replicas=0)
    assert local.info is not None
    host, port = local.info.startup_nodes[0]
    ours = connect(f"redis://{host}:{port}", socket_timeout=2, socket_connect_timeout=2)
    plain = RedisCluster(host=host, port=port, socket_timeout=2, socket_connect_timeout=2)
    try:
        await ours.initialize()
        await plain.initialize()
        dead = ours.get_default_node()
        assert dead.name == plain.get_default_node().name  # both: the first primary
        on_dead = [ours.get_node_from_key(f"k{i}") is dead for i in range(1000)]
        live_key, dead_key = f"k{on_dead.index(False)}", f"k{on_dead.index(True)}"
        local.kill_node(int(dead.port))
        for client in (ours, plain):  # a pipeline's error on the dead shard (a single
            # command's error would also move the dead node last; a pipeline's does not)
            with pytest.raises(RedisConnectionError):
                await _pipeline(client, ("SET", dead_key, "x"))
        if _REDIS_PY < (8, 2):  # what the fix is for (redis-py 8.2 moves the node itself)
            with pytest.raises(RedisConnectionError):
                await _pipeline(plain, ("INCR", live_key))
        for _ in range(3):  # pipelines and single commands on a live shard keep working
            await _pipeline(ours, ("INCR", live_key), ("EXPIRE", live_key, 60))
            assert await ours.get(live_key)
        assert ours.get_default_node().name != dead.name
    finally:
        await ours.aclose()
        await plain.aclose()
