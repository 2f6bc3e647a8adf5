"""Redis at its memory cap with ``maxmemory-policy noeviction`` (docker-compose.yml's
choice): writes are refused loudly, nothing stored is dropped (hostile-suite style).

A private one-master cluster (every session on one node); a bystander session
finishes a turn, then the node's ``maxmemory`` is set below what it uses. A new turn
gets 503 with a code and a short reason; the bystander's backlog is whole, and a
viewer that resumes from offset 0 through the relay gets every frame of it. Once
memory is available again, the bystander's next turn streams as usual. An evicting
policy would have deleted keys with a TTL, which here is every session key, without a
word.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.broker.rediscluster.publisher import read_backlog
from tests.conftest import PrivateClusterFactory
from tests.integration.test_redis_tls import Viewer
from tests.support.relay import STEP, running
from tests.support.sse import SSEClient
from tests.support.worker import SHORT_REPLIES, Harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(180)
async def test_at_the_memory_cap_writes_are_refused_and_nothing_is_evicted(
    private_cluster: PrivateClusterFactory,
) -> None:
    local = await private_cluster(masters=1, replicas=0)
    assert local.info is not None
    host, port = local.info.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port, socket_timeout=2, socket_connect_timeout=2)
    await redis.initialize()
    nodes = redis.get_primaries()
    harness = Harness(redis)
    try:
        await harness.start_engines(1)
        await harness.start_worker()
        worker = harness.url("/").rstrip("/")
        async with (
            running(local.info, reap_after_s=0) as relay,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        ):
            bystander = await Viewer(http, worker, relay.base, SHORT_REPLIES).open()
            victim = await Viewer(http, worker, relay.base, SHORT_REPLIES).open()
            late: Viewer | None = None
            try:
                await bystander.post("a turn before the cap", max_tokens=24)
                await bystander.until_done()
                stored, _, last = await read_backlog(redis, bystander.sid, 0, 10_000)
                assert stored

                for node in nodes:
                    await redis.config_set("maxmemory-policy", "noeviction", target_nodes=node)
                    info = await redis.info("memory", target_nodes=node)
                    used = int(info["used_memory"])
                    await redis.config_set("maxmemory", max(1, used // 2), target_nodes=node)
                async with asyncio.timeout(STEP * 3):
                    async with http.post(
                        f"{worker}/v1/sessions/{victim.sid}/turns",
                        json={"message": "past the cap", "max_tokens": 8},
                        headers={"Authorization": f"Bearer {victim.token}"},
                    ) as r:
                        body = await r.json()
                assert (r.status, body["error"]) == (503, "redis_unavailable"), body
                assert body["reason"] == "redis refused the command"
                assert r.headers["Retry-After"] == "1"

                # nothing was evicted: the backlog is whole, and a viewer resuming from
                # 0 through the relay gets every frame of the bystander's turn
                again, _, last_again = await read_backlog(redis, bystander.sid, 0, 10_000)
                assert (again, last_again) == (stored, last)
                resp = await http.get(
                    f"{relay.base}/v1/sessions/{bystander.sid}/events",
                    headers={"Authorization": f"Bearer {bystander.token}", "Last-Event-ID": "0"},
                )
                try:
                    assert resp.status == 200, await resp.text()
                    late = Viewer(http, worker, relay.base, SHORT_REPLIES)
                    late.resp = resp
                    late.sid, late.token = bystander.sid, bystander.token
                    late.prompt = bystander.prompt[:1]
                    late._max_tokens = 24
                    late.sse = SSEClient(resp)
                    await late.until_done()
                    assert late.texts == bystander.texts
                finally:
                    resp.close()

                for node in nodes:
                    await redis.config_set("maxmemory", 0, target_nodes=node)
                await bystander.post("a turn after the cap")
                await bystander.until_done()
                assert len(bystander.texts) == 2
            finally:
                victim.close()
                bystander.close()
    finally:
        await harness.stop()
        await redis.aclose()
