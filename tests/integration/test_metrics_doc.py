"""The metrics table (docs/METRICS.md) lists exactly the families a relay and a worker export."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.asyncio import RedisCluster

from relay.broker.rediscluster.broker import RedisBroker
from relay.edge.fanout.hub import Hub
from relay.edge.metrics import RelayMetrics
from relay.service.supervise import Supervisor
from worker.metrics import WorkerMetrics
from worker.routing.blockindex import BlockIndex
from worker.routing.kvevents import KVEventFollower
from worker.routing.lease import EngineSpec
from worker.routing.router import Router

METRICS = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"


def _exported(text: bytes) -> set[str]:
    names = {m.decode() for m in re.findall(rb"^# TYPE (\S+) ", text, re.M)}
    return {n for n in names if not n.endswith("_created")}  # prometheus-client's extras


def _documented() -> set[str]:
    return set(re.findall(r"`(tokenrelay_[a-z_]+)", METRICS.read_text()))


@pytest.mark.integration
async def test_every_exported_metric_is_documented_and_every_documented_one_exported(
    redis: RedisCluster,
) -> None:
    hub = Hub(RedisBroker(redis, "metrics-doc"), reap_interval_s=0)
    await hub.start()
    try:
        relay = RelayMetrics("metrics-doc")
        relay.bind_hub(hub.stats)
        Supervisor(relay.registry)  # the background loops' families, as a relay declares them
        exported = _exported(relay.render()[0])
    finally:
        await hub.close()
    worker = WorkerMetrics()
    Supervisor(worker.registry)
    worker.bind_router(Router([EngineSpec(id="e", url="http://e", cap=1)]))
    worker.bind_kv_events(KVEventFollower(BlockIndex()))
    exported |= _exported(worker.render())
    documented = _documented()
    assert exported - documented == set(), "exported but not in docs/METRICS.md"
    assert documented - exported == set(), "in docs/METRICS.md but not exported"
