"""Cache affinity end to end (3 mock engines, 200 concurrent multi-turn sessions):
the prefix-cache hit rate the mock engines report under the ring beside round robin."""

from __future__ import annotations

import pytest
from redis.asyncio import RedisCluster

from bench.routing.affinity import AffinityConfig, run
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(240)
async def test_ring_routing_makes_the_engines_caches_hit_more_than_round_robin(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    res = await run(AffinityConfig(sessions=200, turns=4), redis, cluster.url)
    ring, rr = res["policies"]["ring"], res["policies"]["round_robin"]
    for r in (ring, rr):
        assert r["errors"] == 0, r["error_samples"]
        assert r["turns_done"] == 800
        assert r["prompt_tokens"] > 0
    print(f"hit rate: ring {ring['hit_rate']}, round robin {rr['hit_rate']}")
    assert ring["hit_rate"] > rr["hit_rate"] + 0.05
    # every engine got its share of the sessions and of the hits
    assert min(ring["hit_rate_per_engine"].values()) > rr["hit_rate"]
