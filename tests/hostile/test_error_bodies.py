"""Error bodies carry a code and a short reason, never an internal address (hostile-suite
style: a bystander session on a healthy shard must be unaffected).

A private 3-master cluster; one master is killed. A turn for a session on the dead
shard gets 503 from the worker, a stream of it 503 from the relay, and both
``/readyz`` answer: every body holds an ``error``/``status`` code and a reason, and none
names a node (no host, no port). A turn whose engine cannot be reached ends with an
``error`` frame that says so without the engine's URL. The bystander, on a live shard,
streams both of its turns through the same relay and worker meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from devstack.cluster.launcher import LocalCluster
from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.protocol.keys import live_channel
from relay.protocol.slotmap import slot_of
from tests.conftest import PrivateClusterFactory
from tests.integration.test_redis_tls import Viewer
from tests.support.relay import STEP, running
from tests.support.worker import SHORT_REPLIES, Harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def _master_of(local: LocalCluster, sid: str) -> int:
    masters = await local.masters_now()
    slot = slot_of(live_channel(sid))
    return next(port for port, slots in masters.items() if slot in slots)


def _no_address(body: str, local: LocalCluster, *extra: str) -> None:
    assert "127.0.0.1" not in body, body
    for node in local.info.nodes if local.info else []:
        assert str(node.port) not in body, body
    for word in extra:
        assert word not in body, body


async def _json(resp: aiohttp.ClientResponse) -> tuple[int, dict[str, Any], str]:
    text = await resp.text()
    return resp.status, await resp.json(content_type=None), text


@pytest.mark.timeout(180)
async def test_redis_and_engine_failures_answer_a_code_and_a_short_reason_only(
    private_cluster: PrivateClusterFactory,
) -> None:
    local = await private_cluster(masters=3, replicas=0)
    assert local.info is not None
    host, port = local.info.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port, socket_timeout=2, socket_connect_timeout=2)
    await redis.initialize()
    harness = Harness(redis)
    try:
        engines = await harness.start_engines(1)
        await harness.start_worker()
        worker = harness.url("/").rstrip("/")
        async with (
            running(local.info, reap_after_s=0) as relay,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http,
        ):
            bystander = await Viewer(http, worker, relay.base, SHORT_REPLIES).open()
            healthy = await _master_of(local, bystander.sid)
            victims: list[Viewer] = []
            for _ in range(40):  # a session on another master: about 1 in 3 per try
                v = await Viewer(http, worker, relay.base, SHORT_REPLIES).open()
                if await _master_of(local, v.sid) != healthy:
                    victims.append(v)
                    break
                v.close()
            assert victims, "no session landed on another master in 40 tries"
            victim = victims[0]
            dead = await _master_of(local, victim.sid)
            try:
                await bystander.post("turn one of the bystander")
                await bystander.until_done()

                local.kill_node(dead)
                # a turn on the dead shard: 503, a code, a short reason, no address
                async with asyncio.timeout(STEP * 3):
                    async with http.post(
                        f"{worker}/v1/sessions/{victim.sid}/turns",
                        json={"message": "into the void", "max_tokens": 8},
                        headers={"Authorization": f"Bearer {victim.token}"},
                    ) as r:
                        status, body, text = await _json(r)
                assert (status, body["error"]) == (503, "redis_unavailable"), text
                assert body["reason"] == "redis did not answer"
                _no_address(text, local)
                # a new stream of the dead shard's session on the relay: the same
                async with asyncio.timeout(STEP * 3):
                    async with http.get(
                        f"{relay.base}/v1/sessions/{victim.sid}/events",
                        headers={"Authorization": f"Bearer {victim.token}"},
                    ) as r:
                        status, body, text = await _json(r)
                assert (status, body["error"]) == (503, "unavailable"), text
                assert body["reason"] == "cannot watch the session"
                _no_address(text, local)
                # readiness, whichever node the ping reached
                for base in (relay.base, worker):
                    async with http.get(base + "/readyz") as r:
                        _no_address(await r.text(), local)

                # a turn on a healthy shard is not refused because another is dead
                await bystander.post("turn two of the bystander")
                await bystander.until_done()
                assert len(bystander.texts) == 2

                # an engine that cannot be reached: the turn's error frame says so in a
                # few words, without the engine's URL (the bystander's turns are over)
                await engines[0].stop()
                await bystander.post("turn three, engine gone")
                kinds, texts = await _frames_until_end(bystander)
                assert kinds[-1] == "error", kinds
                assert texts[-1] == "engine unreachable", texts
                _no_address(texts[-1], local, engines[0].url)
            finally:
                victim.close()
                bystander.close()
    finally:
        await harness.stop()
        await redis.aclose()


async def _frames_until_end(v: Viewer) -> tuple[list[str], list[str]]:
    assert v.sse is not None
    kinds: list[str] = []
    texts: list[str] = []
    async with asyncio.timeout(STEP * 3):
        while not kinds or kinds[-1] not in ("done", "error"):
            ev = await v.sse.next_event()
            assert ev is not None, "the stream ended"
            kinds.append(ev[1])
            texts.append(ev[2].get("text", ""))
    return kinds, texts
