"""Smoke test of ``bench.peers.durable``: a tiny configuration of every phase (appends,
a catch-up read, SSE and long-poll readers) for the reference server in both modes and
tokenrelay on one and two relays, on the suite's cluster. It checks the shape of the
JSON the benchmark writes, that no reader lost or doubled a message and that the
table renders; it checks no speed. Skipped with the reason where node/npm are missing
or npm cannot install the reference server (no access to the registry), and where the
relay has no Durable Streams routes.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench.peers.durable import SYSTEMS, Config, routes_missing, run
from bench.peers.durable_node import ensure_reference
from bench.peers.durable_report import table
from devstack.cluster.launcher import ClusterInfo

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = Config(
    seconds=1.5,
    append_streams=2,
    append_conc=4,
    catchup_mb=0.5,
    catchup_readers=2,
    streams=4,
    readers=3,
    rate=40.0,
    warm_s=0.3,
    repeats=1,
)
CPU = ("server_us", "redis_us", "total_us")


@pytest.mark.timeout(420)
async def test_tiny_run_has_every_figure_and_loses_nothing(cluster: ClusterInfo) -> None:
    why = await asyncio.to_thread(routes_missing)
    if why is not None:
        pytest.skip(why)
    modules = await asyncio.to_thread(ensure_reference)
    if isinstance(modules, str):
        pytest.skip(modules)
    res = await run(TINY, cluster.url, modules)
    json.loads(json.dumps(res))  # what --json writes
    assert set(res["phases"]) == {"append", "catchup", "sse", "longpoll"}
    for name in SYSTEMS:
        ph = {p: res["phases"][p][name] for p in res["phases"]}
        for p, r in ph.items():
            for k in CPU:
                assert isinstance(r[k], int | float), (p, name, k)
                assert math.isfinite(r[k]), (p, name, k)
            assert r["server_us"] > 0, (p, name)
            assert r["total_us"] == pytest.approx(r["server_us"] + r["redis_us"], abs=0.2)
            assert (r["redis_us"] > 0) == name.startswith("tokenrelay"), (p, name, r)
        assert ph["append"]["acks"] > 0, ph["append"]
        assert ph["append"]["errors"] == 0, ph["append"]
        assert ph["catchup"]["bytes"] >= TINY.catchup_readers * 500_000
        assert ph["catchup"]["bytes"] % 500_000 == 0  # whole reads of the stream only
        assert ph["catchup"]["mb_per_s"] > 0
        for p in ("sse", "longpoll"):
            r = ph[p]
            assert r["errors"] == 0, (p, name, r["error_sample"])
            assert r["sent"] > 0
            assert r["held"] == r["sent"], (p, name)  # nothing failed at this rate
            assert r["received"] == r["held"] * TINY.readers, (p, name)
            assert r["lost"] == 0
            assert 0 < r["p50_ms"] <= r["p99_ms"], (p, name)
    assert res["versions"]["@durable-streams/server"] == "0.3.7"
    assert res["server_log_tracebacks"] == 0
    text = table(res)
    assert all(f"| {name} |" in text for name in SYSTEMS)
