"""The production :class:`relay.broker.base.Broker`: a Redis 7 Cluster.

Live frames come through :class:`relay.broker.rediscluster.subscriber.ShardedSubscriber`
(one pubsub connection per node, ``SSUBSCRIBE`` per session channel, read in the
transport's callbacks); backlog reads, seals and reaps are the scripts of
:mod:`relay.broker.rediscluster.publisher` (one round trip each, on the session's slot);
presence is :class:`relay.broker.rediscluster.presence.Presence` (one entry per relay in
a sorted set per session, refreshed by one timer), and the screen counts its
:func:`relay.broker.rediscluster.presence.write_screens` (one script per session, one
pipeline per call). Every redis-py error arrives as a
:class:`relay.broker.errors.RelayError` (:func:`relay.broker.rediscluster.errors.map_redis_errors`).

Order of use (the edge server does this)::

    broker = RedisBroker(redis, "edge-1", maxlen=..., ttl_s=...)
    hub = Hub(broker, ...)       # binds the broker's handlers
    await hub.start()            # broker.start(supervisor): subscriber, presence
    ...
    await hub.close()            # broker.close(): presence removed, connections closed
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Self

from redis.asyncio.cluster import RedisCluster

from relay.broker.base import BacklogPage, MessageHandler, ReapResult, ResubscribedHandler
from relay.broker.errors import RelayError, SessionDeleted, SubscribeError
from relay.broker.rediscluster.connect import RedisTLS, connect
from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.presence import PRESENCE_TTL_S, Presence, write_screens
from relay.broker.rediscluster.publisher import read_backlog_page, reap, seal
from relay.broker.rediscluster.relays import Heartbeats
from relay.broker.rediscluster.streams import RedisStreams
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.protocol.frame import FrameError, decode
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    OWNER_FIELD,
    SESSION_TTL_S,
    gone_key,
    live_channel,
    log_key,
    meta_key,
    owner_key,
)
from relay.service.supervise import Supervisor

__all__ = ["RedisBroker"]

_SCAN: Final = 256  # backlog entries per round trip when looking for a turn's start


class RedisBroker:
    """The edge's backend on a Redis 7 Cluster. See the module docstring.

    ``maxlen`` / ``max_bytes`` / ``ttl_s``: the backlog's bounds and the session lifetime
    that seals and reaps keep (the producers' own settings: ``--backlog-maxlen``,
    ``--backlog-max-bytes``, ``--session-ttl-s``).
    """

    def __init__(
        self,
        redis: RedisCluster,
        relay_id: str,
        *,
        read_from_replicas: bool = False,
        presence_ttl_s: float = PRESENCE_TTL_S,
        maxlen: int = BACKLOG_MAXLEN,
        ttl_s: int = SESSION_TTL_S,
        max_bytes: int = BACKLOG_MAX_BYTES,
    ) -> None:
        self.redis = redis
        self.relay_id = relay_id
        self.read_from_replicas = read_from_replicas
        self.maxlen, self.ttl_s, self.max_bytes = maxlen, ttl_s, max_bytes
        self.presence = Presence(redis, relay_id, ttl_s=presence_ttl_s)
        self.heartbeats = Heartbeats(redis, relay_id, on_dead=self._dead, on_lapsed=self._lapsed)
        self._on_recount: Callable[[], None] | None = None
        self.subscriber: ShardedSubscriber | None = None  # made by start()
        self._on_message: MessageHandler | None = None
        self._on_resubscribed: ResubscribedHandler | None = None
        self._sids: dict[str, str] = {}  # channel name -> session id, while subscribed
        # a second reader of the same subscriber (the Durable Streams live reads, which
        # the hub hands every read to, after its own fan-out: :attr:`Hub.tap`): its
        # channels are held while either side wants them
        self._tapped: set[str] = set()
        self._streams = RedisStreams(redis)

    @property
    def streams(self) -> RedisStreams:
        """Durable Streams on the same cluster (:class:`relay.broker.port.StreamsBroker`)."""
        return self._streams

    @classmethod
    async def connect(
        cls, url: str, relay_id: str, *, tls: RedisTLS | None = None, **kwargs: Any
    ) -> Self:
        """A broker on its own cluster client for ``url`` (``kwargs``: the constructor's;
        closed by :meth:`aclose`); redis-py's errors when the cluster cannot be reached
        (the caller names the URL and the cause)."""
        client = connect(url, tls=tls)  # a burst waits
        try:
            await client.initialize()
        except BaseException:
            await client.aclose()
            raise
        return cls(client, relay_id, **kwargs)

    async def aclose(self) -> None:
        """Close the cluster client (after :meth:`close`)."""
        await self.redis.aclose()

    def channel(self, sid: str) -> bytes:
        return live_channel(sid).encode()

    def bind(
        self, on_message: MessageHandler, on_resubscribed: ResubscribedHandler,
        on_recount: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self._on_message, self._on_resubscribed = on_message, on_resubscribed
        self._on_recount = on_recount

    def _dead(self, dead: Mapping[str, int]) -> None:
        """Relays ``dead`` died: their entries and counts go from every session here."""
        self.presence.drop_dead(dead, self.heartbeats.ttl_s)

    def _lapsed(self) -> None:
        """This relay was taken for dead (it stalled): its entries and counts again."""
        self.presence.rewrite()
        if self._on_recount is not None:
            self._on_recount()

    async def start(self, supervisor: Supervisor) -> None:
        if self._on_message is None:
            raise RuntimeError("bind the broker's handlers before starting it")
        self.subscriber = ShardedSubscriber(
            self.redis,
            on_message=self._on_message,
            on_resubscribed=self._resubscribed,
            relay_id=self.relay_id,
            read_from_replicas=self.read_from_replicas,
            supervisor=supervisor,
        )
        await self.subscriber.start()
        self.presence.start(supervisor)
        self.heartbeats.start(supervisor)

    async def close(self) -> None:
        await self.presence.close()
        await self.heartbeats.close()
        if self.subscriber is not None:
            await self.subscriber.close()

    async def subscribe(self, sid: str) -> None:
        if self.subscriber is None:
            raise SubscribeError("the broker has not started")
        name = live_channel(sid)
        self._sids[name] = sid
        try:
            await self.subscriber.subscribe([name])
        except BaseException:
            self._sids.pop(name, None)
            raise

    def unsubscribe(self, sid: str) -> None:
        name = live_channel(sid)
        self._sids.pop(name, None)
        if self.subscriber is not None and name not in self._tapped:
            self.subscriber.unsubscribe([name])

    async def tap_subscribe(self, channel: str) -> None:
        """Subscribe ``channel`` for the tap (a session's channel may be the hub's too)."""
        if self.subscriber is None:
            raise SubscribeError("the broker has not started")
        self._tapped.add(channel)
        try:
            await self.subscriber.subscribe([channel])
        except BaseException:
            self._tapped.discard(channel)
            raise

    def tap_unsubscribe(self, channel: str) -> None:
        self._tapped.discard(channel)
        if self.subscriber is not None and channel not in self._sids:
            self.subscriber.unsubscribe([channel])

    async def read_page(
        self, sid: str, after: int | None, count: int, max_bytes: int
    ) -> BacklogPage:
        return await read_backlog_page(
            self.redis, sid, after or 0, count if after is not None else 0, max_bytes
        )

    async def seal(self, sid: str, seen: int, gen: str) -> int:
        return await seal(
            self.redis, sid, seen, sealer=self.relay_id, maxlen=self.maxlen, ttl_s=self.ttl_s,
            gen=gen, max_bytes=self.max_bytes,
        )  # fmt: skip

    async def reap(self, sid: str) -> ReapResult:
        return await reap(
            self.redis, sid, reaper=self.relay_id, maxlen=self.maxlen, ttl_s=self.ttl_s,
            max_bytes=self.max_bytes,
        )  # fmt: skip

    def present(self, sid: str) -> None:
        self.presence.add(sid)

    def absent(self, sid: str) -> None:
        self.presence.remove(sid)

    async def screens(self, counts: Sequence[tuple[str, int]]) -> list[int | RelayError]:
        return await write_screens(
            self.redis, counts, self.relay_id, ttl_s=self.presence.ttl_s,
            dead=self.heartbeats.dead, silent_s=self.heartbeats.ttl_s,
        )  # fmt: skip

    async def active_turn(self, sid: str) -> tuple[int, int] | None:
        """The session's ``open`` marker (and its tombstone, in the same round trip: a
        deleted session raises :class:`SessionDeleted`), then the backlog walked back from
        its end to the turn's first frame (a reply is a few hundred frames: one or two
        trips)."""
        with map_redis_errors():
            async with self.redis.pipeline(transaction=False) as p:  # one slot: one trip
                p.hmget(meta_key(sid), ["open", "offset"])
                p.exists(gone_key(sid))
                (opened, offset), gone = await p.execute()
            if gone:
                raise SessionDeleted(sid)
            if not opened:
                return None
            turn, after = int(opened), int(offset or 0)
            top = "+"
            while True:
                entries: list[Any] = (
                    await self.redis.xrevrange(log_key(sid), max=top, min="-", count=_SCAN) or []
                )
                for _id, fields in entries:
                    try:
                        frame = decode(fields[b"f"])
                    except (FrameError, KeyError, TypeError):
                        continue
                    if frame.turn != turn:  # an older turn, or a gap (turn 0): stop there
                        return turn, frame.offset
                    after = frame.offset - 1
                if len(entries) < _SCAN or after <= 0:
                    return turn, max(after, 0)
                top = f"{after}-1"  # entry ids are "<offset>-1": go on below the oldest read

    async def response_head(self, sid: str, offset: int) -> tuple[str, bytes | None]:
        """The session's API owner tag and the frame at ``offset``, with its tombstone,
        in one round trip (the session's keys share a slot)."""
        with map_redis_errors():
            async with self.redis.pipeline(transaction=False) as p:
                p.hget(owner_key(sid), OWNER_FIELD)
                p.exists(gone_key(sid))
                at = f"{offset}-1"
                p.xrange(log_key(sid), min=at, max=at, count=1)
                owner, gone, entries = await p.execute()
        if gone:
            raise SessionDeleted(sid)
        frame: bytes | None = None
        for _id, fields in entries or []:
            frame = fields.get(b"f")
        return (owner.decode() if isinstance(owner, bytes) else owner or ""), frame

    async def ping(self) -> None:
        with map_redis_errors():
            await self.redis.ping()

    def stats(self) -> Mapping[str, Any]:
        out: dict[str, Any] = dict(self.presence.stats)
        sub = self.subscriber
        out["channels_per_node"] = sub.channels_per_node() if sub is not None else {}
        out["resubscribes"] = sub.stats["resubscribes"] if sub is not None else 0
        out["subscriber"] = dict(sub.stats) if sub is not None else {}
        return out

    def _resubscribed(self, names: list[str]) -> None:
        assert self._on_resubscribed is not None
        sids = [sid for n in names if (sid := self._sids.get(n)) is not None]
        if sids:
            self._on_resubscribed(sids)
