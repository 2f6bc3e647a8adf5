"""The relay exports what only grows as counters, and declares every hub number it exports."""

from __future__ import annotations

import re

import pytest
from redis.asyncio import RedisCluster

from relay.broker.rediscluster.broker import RedisBroker
from relay.edge.fanout.hub import Hub
from relay.edge.metrics import HUB_METRICS, RelayMetrics

pytestmark = pytest.mark.integration


async def test_every_hub_number_is_declared_and_growing_ones_are_counters(
    redis: RedisCluster,
) -> None:
    hub = Hub(RedisBroker(redis, "metric-types"), reap_interval_s=0)
    await hub.start()
    try:
        stats = hub.stats()
        metrics = RelayMetrics("metric-types")
        metrics.bind_hub(hub.stats)
        text = metrics.render()[0].decode()
    finally:
        await hub.close()
    assert set(stats) - set(HUB_METRICS) == set(), "hub.stats() keys nobody declared"
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name in ("sealed", "reaped", "reap_checks", "reap_errors", "writes_direct",
                 "writes_queued", "replay_budget_waits", "subscriber"):  # fmt: skip
        assert types.get(f"tokenrelay_relay_hub_{name}_total") == "counter", name
        assert f"tokenrelay_relay_hub_{name} " not in text, name  # no gauge left behind
    for name in ("watches", "channels", "replay_budget_used", "replay_budget_peak"):
        assert types.get(f"tokenrelay_relay_hub_{name}") == "gauge", name
    assert 'tokenrelay_relay_hub_subscriber_total{key="map_refreshes"}' in text
