"""Scripts in batches (:func:`relay.broker.rediscluster.scripts.run_batch`), on the real
cluster: a relay's screen counts for sessions on every shard in one call, by
``EVALSHA``; after every master lost its script cache (a restart, a promoted replica:
``SCRIPT FLUSH`` here), the calls a node answers ``NOSCRIPT`` are sent again by
``EVAL`` and every count is still written, once; the next batch is ``EVALSHA`` only."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import SessionDeleted
from relay.broker.rediscluster.presence import write_screens
from relay.protocol.keys import gone_key, new_session_id, screens_key

pytestmark = pytest.mark.integration


async def _masters(redis: RedisCluster) -> list[aioredis.Redis]:
    return [aioredis.Redis(host=n.host, port=int(n.port)) for n in redis.get_primaries()]


async def _calls(nodes: list[aioredis.Redis], name: str) -> int:
    total = 0
    for node in nodes:
        info = await node.info("commandstats")
        total += int(info.get(f"cmdstat_{name}", {}).get("calls", 0))
    return total


async def test_screen_counts_of_many_sessions_in_one_batch_survive_an_empty_script_cache(
    redis: RedisCluster,
) -> None:
    sids = [new_session_id() for _ in range(30)]
    counts = [(sid, 1 + i % 4) for i, sid in enumerate(sids)]
    assert await write_screens(redis, counts, "edge-batch") == [n for _, n in counts]
    masters = await _masters(redis)
    nodes = {redis.get_node_from_key(screens_key(s)) for s in sids}
    assert None not in nodes
    assert len(nodes) == len(masters)  # every shard has some
    try:
        for node in masters:
            await node.script_flush()
            await node.config_resetstat()
        again = [(sid, n + 1) for sid, n in counts]
        assert await write_screens(redis, again, "edge-batch") == [n for _, n in again]
        assert await _calls(masters, "evalsha") == len(sids)  # every one refused, then
        assert await _calls(masters, "eval") == len(sids)  # sent again, and loaded
        for sid, n in again:
            assert await redis.hget(screens_key(sid), "edge-batch") == str(n).encode()
        for node in masters:
            await node.config_resetstat()
        assert await write_screens(redis, counts, "edge-batch") == [n for _, n in counts]
        assert await _calls(masters, "eval") == 0
        # one deleted session among them: its own answer, the others written
        await redis.set(gone_key(sids[0]), "1", ex=60)
        got = await write_screens(redis, [(sids[0], 2), (sids[1], 3)], "edge-batch")
        assert isinstance(got[0], SessionDeleted)
        assert got[1] == 3
    finally:
        for node in masters:
            await node.aclose()
