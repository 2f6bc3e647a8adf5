"""Shared fixtures: one real Redis Cluster for the whole run.

Backends, by environment:
- default: a local cluster (3 masters + 3 replicas) on free loopback ports, started by
  :mod:`devstack.cluster.launcher` and stopped by pid at the end of the session, even on failure;
- ``TOKENRELAY_REDIS_URL=redis://host:port``: an existing cluster (never torn down);
- ``TOKENRELAY_TEST_BACKEND=docker``: a Redis 7 cluster in containers (testcontainers);
  skipped with a reason when no Docker engine answers.

Tests that damage a cluster (kill a master, pause a node, reshard) must not use the
shared one: they start their own with the ``private_cluster`` factory.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.form import Node
from devstack.cluster.launcher import ClusterInfo, LocalCluster
from devstack.rabbit import AMQP_ENV, RabbitMissing, find_rabbit, local_rabbit
from relay.broker.rediscluster.connect import GatedRedisCluster
from tests.support.worker import Harness


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # lets the session fixture's finally run


signal.signal(signal.SIGTERM, _raise_on_sigterm)


async def _info_from_url(url: str) -> ClusterInfo:
    """Describe an existing cluster from CLUSTER NODES."""
    client = aioredis.Redis.from_url(url)
    try:
        text = (await client.execute_command("CLUSTER", "NODES")).decode()
    finally:
        await client.aclose()
    nodes: list[Node] = []
    ports: dict[str, int] = {}
    rows = [ln.split() for ln in text.splitlines() if ln.strip()]
    for parts in rows:
        host, port = parts[1].split("@")[0].rsplit(":", 1)
        ports[parts[0]] = int(port)
    for parts in rows:
        host, port = parts[1].split("@")[0].rsplit(":", 1)
        role = "replica" if "slave" in parts[2] else "master"
        master_port = ports.get(parts[3], 0) if role == "replica" else 0
        nodes.append(Node(host or "127.0.0.1", int(port), role, 0, parts[0], master_port))
    nodes.sort(key=lambda n: (n.role != "master", n.port))
    return ClusterInfo(nodes=nodes, data_dir="", binary="external", flavor="external", version="")


@pytest.fixture(scope="session")
async def cluster() -> AsyncIterator[ClusterInfo]:
    """The session's real Redis Cluster."""
    url = os.environ.get("TOKENRELAY_REDIS_URL")
    backend = os.environ.get("TOKENRELAY_TEST_BACKEND", "local")
    if url:
        yield await _info_from_url(url)
        return
    if backend == "docker":
        from tests.support.docker_backend import docker_cluster

        async with docker_cluster() as info:
            yield info
        return
    local = LocalCluster(masters=3, replicas=1)
    try:
        yield await local.start()
    finally:
        await local.stop()


@pytest.fixture(scope="session")
async def amqp_or_why(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The URL of a RabbitMQ broker of this run's own: the one ``make test`` started around
    the whole run (``TOKENRELAY_TEST_AMQP``), else one started here for this process and
    stopped by pid after it (devstack/rabbit.py); where ``rabbitmq-server`` is not
    installed, the reason, starting with "no:". Never a broker that happens to be on the
    host."""
    url = os.environ.get(AMQP_ENV)
    if url:
        yield url
        return
    try:
        find_rabbit()
    except RabbitMissing as exc:
        yield f"no: {exc}"
        return
    async with local_rabbit(tmp_path_factory.mktemp("rabbit")) as started:
        yield started


@pytest.fixture
def amqp(amqp_or_why: str) -> str:
    """:func:`amqp_or_why`'s broker; the test skips with the reason where there is none."""
    if amqp_or_why.startswith("no: "):
        pytest.skip(amqp_or_why.removeprefix("no: "))
    return amqp_or_why


@pytest.fixture
async def redis(cluster: ClusterInfo) -> AsyncIterator[RedisCluster]:
    """A fresh cluster client per test (tests may leave it in any state): the gated
    client the relay and the worker use (see relay.broker.rediscluster.connect)."""
    host, port = cluster.startup_nodes[0]
    client = GatedRedisCluster(host=host, port=port)
    await client.initialize()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def h(redis: RedisCluster) -> AsyncIterator[Harness]:
    """In-process mock engines and a worker (tests/support/worker.py), stopped after."""
    harness = Harness(redis)
    yield harness
    await harness.stop()


PrivateClusterFactory = Callable[..., Awaitable[LocalCluster]]


@pytest.fixture
async def private_cluster() -> AsyncIterator[PrivateClusterFactory]:
    """Start a throwaway cluster a test may damage; stopped by pid after the test."""
    if os.environ.get("TOKENRELAY_REDIS_URL"):
        pytest.skip("fault tests need a cluster of their own; TOKENRELAY_REDIS_URL is set")
    async with AsyncExitStack() as stack:

        async def make(**kwargs: Any) -> LocalCluster:
            local = LocalCluster(**kwargs)
            stack.push_async_callback(local.stop)
            await local.start()
            return local

        yield make


_passed = 0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run in which no test passed (all skipped or deselected) is not green: CI must
    not mistake "nothing ran" for "everything passed"."""
    if exitstatus == 0 and _passed == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
