"""The PUBLISH vs SPUBLISH benchmark measures the physics of the cluster bus.

On the session cluster (3 masters + 3 replicas): a classic PUBLISH is sent over the bus
to every other node (nodes - 1 sends per message), a SPUBLISH only to the replicas of
the owning shard (1 per message with one replica per master). A tiny workload, the
publishers in this process, no worker processes.
"""

from __future__ import annotations

import json

import pytest

from bench.pubsub.cluster import RUN_KEYS, Workload, markdown, measure
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Workload(channels=16, fixed_rate=1000, fixed_s=0.3, max_s=0.5, publisher_procs=0, repeats=1)


def _replicas_per_master(cluster: ClusterInfo) -> float:
    return len(cluster.replicas) / len(cluster.masters)


@pytest.mark.timeout(30)
async def test_publish_is_broadcast_to_every_other_node(cluster: ClusterInfo) -> None:
    run = await measure(cluster, "publish", TINY)
    assert run["max_published"] > 1000
    assert run["bus_sends_per_msg"] == pytest.approx(len(cluster.nodes) - 1, abs=0.05)
    assert run["fixed_bus_sends_per_msg"] == pytest.approx(len(cluster.nodes) - 1, abs=0.05)
    assert run["bus_received_per_msg"] == pytest.approx(run["bus_sends_per_msg"], abs=0.05)
    assert run["delivered_ratio"] == pytest.approx(1.0, abs=0.01)
    assert run["fixed_delivered_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.timeout(30)
async def test_spublish_reaches_only_the_owning_shard(cluster: ClusterInfo) -> None:
    run = await measure(cluster, "spublish", TINY)
    assert run["max_published"] > 1000
    assert run["bus_sends_per_msg"] == pytest.approx(_replicas_per_master(cluster), abs=0.05)
    assert run["publish_sent_delta"] == 0
    assert run["delivered_ratio"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.timeout(30)
async def test_run_record_has_the_documented_keys(cluster: ClusterInfo) -> None:
    run = await measure(cluster, "spublish", TINY)
    assert set(RUN_KEYS) <= set(run)
    assert run["mode"] == "spublish"
    assert run["masters"] == len(cluster.masters)
    assert run["latency_p50_ms"] is not None
    assert run["latency_p99_ms"] >= run["latency_p50_ms"] > 0
    assert run["cpu_s_per_100k"] > 0
    result = {
        "server": "test",
        "replicas_per_master": 1,
        "workload": TINY.__dict__,
        "note": "n",
        "runs": [run],
    }
    assert "| SPUBLISH |" in markdown(result)
    assert json.loads(json.dumps(result))["runs"][0]["mode"] == "spublish"
