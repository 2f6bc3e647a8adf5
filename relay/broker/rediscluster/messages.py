"""Messages to a named shard channel (:class:`relay.broker.port.Messages`) on a Redis
Cluster: ``send`` is an SPUBLISH (run as a one-line script so that the channel, as its
key, routes the call to its shard), ``listen`` an SSUBSCRIBE through a
:class:`relay.broker.rediscluster.subscriber.ShardedSubscriber` of its own.

Order of use: ``m = RedisMessages(redis, "ctl-w1")`` -> ``await m.listen(channel,
handler, supervisor)`` -> ``await m.send(other, body)`` ... -> ``await m.unlisten()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.service.supervise import Supervisor

__all__ = ["RedisMessages"]

_SEND_LUA: Final = "return redis.call('SPUBLISH', KEYS[1], ARGV[1])"


class RedisMessages:
    """See the module docstring. ``name`` names the subscriber (its logs, metrics)."""

    def __init__(self, redis: RedisCluster, name: str) -> None:
        self.redis = redis
        self.name = name
        self._sub: ShardedSubscriber | None = None

    async def send(self, channel: str, body: bytes) -> None:
        with map_redis_errors():  # the channel as the script's key: routed to its shard
            await self.redis.eval(_SEND_LUA, 1, channel, body)

    async def listen(
        self, channel: str, handler: Callable[[bytes], None], supervisor: Supervisor
    ) -> None:
        def on_messages(messages: list[list[bytes]]) -> None:
            for msg in messages:
                if len(msg) > 2:
                    handler(msg[2])

        self._sub = ShardedSubscriber(
            self.redis,
            on_message=on_messages,
            on_resubscribed=lambda _channels: None,  # a message missed meanwhile is lost
            relay_id=self.name,
            supervisor=supervisor,
        )
        await self._sub.start()
        await self._sub.subscribe([channel])

    async def unlisten(self) -> None:
        if self._sub is not None:
            await self._sub.close()
