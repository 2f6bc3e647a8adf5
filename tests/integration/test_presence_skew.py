"""Presence by Redis server time: a relay whose host clock is off by 3 seconds (either
way) keeps a watched turn alive. The relay runs as a subprocess whose Python wall clock
(``time.time`` / ``time.time_ns``) is shifted; the worker and Redis keep true time.
Real cluster, real worker, a real hub watch."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.procs import Proc, log_line
from relay.protocol.keys import presence_key
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration

# argv: redis url, clock skew in seconds, session id. Watches the session from 0 until
# SIGTERM, then closes the watch (its presence goes) and exits.
_SKEWED_RELAY = """
import asyncio, signal, sys, time
skew = float(sys.argv[2])
_ns, _t = time.time_ns, time.time
time.time_ns = lambda: _ns() + int(skew * 1e9)
time.time = lambda: _t() + skew
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.connect import connect
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub

async def main() -> None:
    redis = connect(sys.argv[1])
    await redis.initialize()
    hub = Hub(RedisBroker(redis, "skewed-relay"), reap_interval_s=0)
    await hub.start()
    watch = await open_reader(hub, sys.argv[3], 0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("watching", flush=True)
    await stop.wait()
    await watch.close()
    await hub.close()
    await redis.aclose()

asyncio.run(main())
"""


@pytest.mark.parametrize("skew_s", [-3.0, 3.0])
async def test_a_relay_with_a_skewed_clock_keeps_its_turn_alive(
    h: Harness, redis: RedisCluster, cluster: ClusterInfo, skew_s: float, tmp_path: Path
) -> None:
    await h.start_engines(1, decode_tok_per_s=20.0)  # about 2.4 s of tokens: > the grace
    await h.start_worker(presence_grace_s=1.0, presence_interval_s=0.2)
    sid, token = await h.session()
    proc = Proc.start(
        [sys.executable, "-c", _SKEWED_RELAY, cluster.url, str(skew_s), sid],
        log=tmp_path / "skewed.out", err_log=tmp_path / "skewed.err", name="skewed-relay",
    )  # fmt: skip
    try:
        await proc.ready(log_line("\n"), timeout_s=20)
        assert proc.output().splitlines()[0].strip() == "watching"
        async with asyncio.timeout(20):
            while await redis.zscore(presence_key(sid), "skewed-relay") is None:
                await asyncio.sleep(0.05)
        status, body, _ = await h.post_turn(sid, token, {"message": "watched from afar"})
        assert status == 202
        frames = await wait_turn(redis, sid, body["turn"])
    finally:
        await proc.stop(grace_s=10)  # SIGTERM by pid: the watch closes
    assert frames[-1].kind == "done", (frames[-1].kind, frames[-1].text)
    assert await redis.zscore(presence_key(sid), "skewed-relay") is None  # removed on close
