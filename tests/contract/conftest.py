"""The store port's contract runs against every store: ``stores`` is one pair (the
write side, the edge's side) per store, the Redis one on the suite's local cluster
(marked integration: ``make test-fast`` runs the memory store only)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from devstack.cluster.launcher import ClusterInfo
from relay.broker.base import Broker
from relay.broker.memstore import MemoryStore
from relay.broker.port import Messages, Store, StreamsBroker
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.connect import GatedRedisCluster
from relay.broker.rediscluster.store import RedisStore

MAXLEN = 1000
MAX_BYTES = 4000  # the backlog's byte budget in these tests
TTL_S = 60


@dataclass
class Stores:
    """One store: its write side and the edge's reads of the same data."""

    name: str
    store: Store
    edge: Broker
    messages: Messages

    @staticmethod
    def sid() -> str:
        return "c-" + secrets.token_hex(6)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def backend(request: pytest.FixtureRequest) -> ClusterInfo | None:
    """Which store: None for memory, else the suite's cluster (a sync fixture: it may
    start the session's cluster)."""
    if request.param == "memory":
        return None
    info: ClusterInfo = request.getfixturevalue("cluster")
    return info


@pytest.fixture
async def stores(backend: ClusterInfo | None) -> AsyncIterator[Stores]:
    if backend is None:
        mem = MemoryStore("contract", maxlen=MAXLEN, max_bytes=MAX_BYTES, ttl_s=TTL_S)
        assert isinstance(mem, StreamsBroker)
        yield Stores("memory", mem, mem, mem.messages("contract"))
        return
    host, port = backend.startup_nodes[0]
    redis = GatedRedisCluster(host=host, port=port)
    await redis.initialize()
    try:
        store = RedisStore(redis, maxlen=MAXLEN, max_bytes=MAX_BYTES, ttl_s=TTL_S)
        edge = RedisBroker(redis, "contract", maxlen=MAXLEN, ttl_s=TTL_S, max_bytes=MAX_BYTES)
        assert isinstance(edge, StreamsBroker)
        yield Stores("redis", store, edge, store.messages("contract"))
    finally:
        await redis.aclose()
