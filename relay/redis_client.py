"""The Redis Cluster client of every tokenrelay process: redis-py's, made to wait.

redis-py's asyncio :class:`~redis.asyncio.cluster.RedisCluster` keeps at most
``max_connections`` (default 100) connections per node and, when a command needs one
more, raises ``MaxConnectionsError`` at once instead of waiting for one to come back.
A burst therefore fails where it should queue: measured here, 400 concurrent turn
POSTs on one worker got 100 answers ``503 redis_unavailable``.

:class:`GatedRedisCluster` holds one of ``concurrency`` permits for each command and
each pipeline execution, and lets each node's pool hold ``concurrency`` connections.
A command uses one connection on one node and a pipeline at most one per node, so no
node can run out: the caller past the bound waits for a permit. Work a permit holder
starts itself (a pipeline retrying a redirected command through the client, in the
same task or in tasks it spawns) runs under the holder's permit (a context variable),
so a permit never waits for another permit.

Order of use::

    redis = connect("redis://127.0.0.1:7000", concurrency=128)
    await redis.initialize(); ...; await redis.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import Any, Final

from redis.asyncio.cluster import ClusterPipeline, RedisCluster

__all__ = ["DEFAULT_CONCURRENCY", "GatedRedisCluster", "connect"]

DEFAULT_CONCURRENCY: Final = 128

_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("redis_permit", default=False)


class GatedRedisCluster(RedisCluster):
    """A :class:`RedisCluster` whose callers wait (see the module docstring)."""

    def __init__(self, *args: Any, concurrency: int = DEFAULT_CONCURRENCY, **kwargs: Any) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        kwargs.setdefault("max_connections", concurrency)
        if kwargs["max_connections"] < concurrency:
            raise ValueError("max_connections per node must be >= concurrency")
        super().__init__(*args, **kwargs)
        self.concurrency = concurrency
        self.waiting = 0  # callers waiting for a permit now
        self._permits = asyncio.Semaphore(concurrency)

    @contextlib.asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        """Hold one permit for the block; inside a holder's context, hold nothing more."""
        if _holding.get():
            yield
            return
        self.waiting += 1
        try:
            await self._permits.acquire()
        finally:
            self.waiting -= 1
        token = _holding.set(True)
        try:
            yield
        finally:
            _holding.reset(token)
            self._permits.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self.permit():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:  # what redis-py refuses, refused the same way
            return super().pipeline(transaction, shard_hint)
        return _GatedPipeline(self, transaction)  # type: ignore[abstract]  # redis-py stub


class _GatedPipeline(ClusterPipeline):
    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client = self.cluster_client
        assert isinstance(client, GatedRedisCluster)
        async with client.permit():
            return await super().execute(raise_on_error, allow_redirections)


def connect(
    url: str, *, concurrency: int = DEFAULT_CONCURRENCY, **kwargs: Any
) -> GatedRedisCluster:
    """A :class:`GatedRedisCluster` for ``url`` (``redis://host:port``); call
    ``await client.initialize()`` before use, ``await client.aclose()`` after."""
    client = GatedRedisCluster.from_url(url, concurrency=concurrency, **kwargs)
    assert isinstance(client, GatedRedisCluster)
    return client
