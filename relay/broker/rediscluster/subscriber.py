"""The sharded subscriber: one pubsub connection per node, read in its callbacks.

Not redis-py's ``ClusterPubSub`` (bench/relay/subscriber_compare.py measures both): each node
that holds subscriptions gets one raw asyncio connection, parsed with ``hiredis.Reader`` in the
transport's ``data_received`` (no polling, no task in between), which parses every
complete reply of each chunk and hands the chunk's ``smessage``s, in one list, to a
synchronous callback. The reader never awaits a consumer.

Desired state vs actual state: callers say which channels they *want*
(:meth:`ShardedSubscriber.subscribe` / :meth:`~ShardedSubscriber.unsubscribe`); one
sync task makes it so: it groups the pending channels by owner node (slot map from
:mod:`relay.protocol.slotmap`) and writes one ``SSUBSCRIBE`` per slot, all of a node's commands
in one write. Topology changes - an unsolicited ``sunsubscribe`` push (slot moved,
failover), a ``-MOVED`` reply, a dropped connection - put the affected channels back
to pending and mark the slot map stale: the sync task refreshes the map (``CLUSTER
SHARDS``, fallback ``CLUSTER SLOTS``), re-subscribes on the new owner and then calls
``on_resubscribed(channels)`` so the hub repairs the gap from the backlog.

A map can lag: the node asked may not have heard of a failover yet. A channel that a
node unsubscribed us from is therefore not re-subscribed on that node while a fresh
map still lists it as the slot's master; the map is refreshed again (with backoff)
until it has caught up, for at most ``settle_s``. Otherwise the channel could land on
the demoted master before its new master knows it as a replica, which gets no shard
messages meanwhile: the frames of that window would reach no one until the next frame
revealed the hole (and a lost ``done`` never would).

The sync task is the supervised loop ``subscriber`` (:class:`relay.service.supervise.Supervisor`,
the relay's own or one the subscriber makes): a sync round that fails, or leaves
channels pending (no owner yet, a lagging map, a refused ``SSUBSCRIBE``), raises; the
supervisor logs it and starts the loop again after its jittered backoff.

Order of use::

    sub = ShardedSubscriber(redis, on_message=..., on_resubscribed=..., relay_id="r1")
    await sub.start()
    await sub.subscribe([ch, ...])     # returns once SSUBSCRIBE is confirmed
    ...                                # on_message([[b"smessage", channel, data], ...])
                                       # per read chunk of a node's connection
    sub.unsubscribe([ch, ...])
    await sub.close()

Connections are named ``tokenrelay-sub:<relay_id>`` (``CLIENT LIST`` finds them).
They are TLS when the cluster client's are (a ``rediss://`` URL): the same CA, client
certificate and host name check (:func:`relay.broker.rediscluster.connect.ssl_context_of`), and the
nodes' TLS ports from ``CLUSTER SHARDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RedisCommandError, RedisUnavailable, SubscribeError
from relay.broker.rediscluster.connect import ssl_context_of
from relay.broker.rediscluster.nodeconn import MessageHandler, NodeConn, pack_command, raw_command
from relay.protocol.slotmap import Addr, SlotMap, group_by_slot, parse_shards, parse_slots, slot_of
from relay.service.supervise import QUICK_BACKOFF, Supervisor

__all__ = ["NodeConn", "ShardedSubscriber", "pack_command", "raw_command"]

log = logging.getLogger(__name__)

ChannelsHandler = Callable[[list[str]], None]


class ShardedSubscriber:
    """SSUBSCRIBE manager for one relay process. See the module docstring."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        on_message: MessageHandler,
        on_resubscribed: ChannelsHandler,
        relay_id: str,
        read_from_replicas: bool = False,
        subscribe_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        settle_s: float = 5.0,
        supervisor: Supervisor | None = None,
    ) -> None:
        """``supervisor``: run the sync loop on it (the caller stops it before
        :meth:`close`); by default the subscriber runs one of its own."""
        self.redis = redis
        self._owns_supervisor = supervisor is None
        self.supervisor = supervisor or Supervisor(backoff=QUICK_BACKOFF)
        self.on_message = on_message
        self.on_resubscribed = on_resubscribed
        self.client_name = f"tokenrelay-sub:{relay_id}"
        self.read_from_replicas = read_from_replicas
        self.subscribe_timeout_s = subscribe_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.settle_s = settle_s
        kw = redis.get_connection_kwargs()
        user, password = kw.get("username"), kw.get("password")
        self._auth: tuple[str, ...] = ()
        if password:
            self._auth = (str(user), str(password)) if user else (str(password),)
        self._tls = ssl_context_of(redis)  # None: plain TCP, like the cluster client
        self._map: SlotMap | None = None
        self._stale = True
        self._conns: dict[Addr, NodeConn] = {}
        self._wanted: set[str] = set()
        self._pending: set[str] = set()
        self._where: dict[str, Addr] = {}
        self._confirmed_once: set[str] = set()
        # channel -> (node that unsubscribed us, until when its map entry is suspect)
        self._left: dict[str, tuple[Addr, float]] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._kick = asyncio.Event()
        self._closed = False
        self.stats: dict[str, int] = {
            "resubscribes": 0,
            "topology_changes": 0,
            "map_refreshes": 0,
            "connections_lost": 0,
            "ssubscribe_commands": 0,
            "stale_maps": 0,
        }

    # -- public API ------------------------------------------------------------------------

    async def start(self) -> None:
        await self._refresh_map()
        # critical: a relay whose subscriber cannot subscribe streams nothing live, so
        # /readyz must send its clients elsewhere rather than serve a frozen feed
        self.supervisor.forever("subscriber", self._sync_loop, critical=True)

    async def subscribe(self, channels: Sequence[str]) -> None:
        """Subscribe (once per relay) and wait for the server's confirmation.

        Raises :class:`SubscribeError` after ``subscribe_timeout_s``; the channels that
        were new are then given up again (rollback).
        """
        if self._closed:
            raise SubscribeError("subscriber closed")
        loop = asyncio.get_running_loop()
        new = [c for c in channels if c not in self._wanted]
        self._wanted.update(new)
        self._pending.update(new)
        mine: list[tuple[str, asyncio.Future[None]]] = []
        for c in channels:
            if c not in self._where:
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.setdefault(c, []).append(fut)
                mine.append((c, fut))
        if not mine:
            return
        self._kick.set()
        try:
            async with asyncio.timeout(self.subscribe_timeout_s):
                await asyncio.gather(*(f for _, f in mine))
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._forget_waiters(mine)  # else a channel never confirmed keeps an entry
            for c in new:
                self._give_up(c)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise SubscribeError(f"no confirmation for {len(mine)} channel(s)") from None

    def unsubscribe(self, channels: Iterable[str]) -> None:
        """Give the channels up now (one SUNSUBSCRIBE per slot, no reply awaited)."""
        for c in channels:
            self._give_up(c)

    def node_of(self, channel: str) -> Addr | None:
        return self._where.get(channel)

    def channels_per_node(self) -> dict[str, int]:
        return {str(a): len(c.channels) for a, c in self._conns.items() if c.channels}

    async def close(self) -> None:
        self._closed = True
        if self._owns_supervisor:
            await self.supervisor.stop()
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            await conn.close()
        for futs in self._waiters.values():
            for f in futs:
                if not f.done():
                    f.set_exception(SubscribeError("subscriber closed"))
        self._waiters.clear()

    # -- internals -------------------------------------------------------------------------

    def _forget_waiters(self, mine: list[tuple[str, asyncio.Future[None]]]) -> None:
        for c, fut in mine:
            waiting = self._waiters.get(c)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiters[c]

    def _give_up(self, c: str) -> None:
        self._left.pop(c, None)
        self._wanted.discard(c)
        self._pending.discard(c)
        self._confirmed_once.discard(c)
        addr = self._where.pop(c, None)
        conn = self._conns.get(addr) if addr is not None else None
        if conn is not None and conn.alive:
            with contextlib.suppress(RedisUnavailable):
                conn.sunsubscribe([c])

    def _confirm(self, c: str, addr: Addr, resub: list[str]) -> None:
        if c not in self._wanted:  # given up while the SSUBSCRIBE was in flight
            conn = self._conns.get(addr)
            if conn is not None and conn.alive and c not in self._where:
                with contextlib.suppress(RedisUnavailable):
                    conn.sunsubscribe([c])
            return
        self._pending.discard(c)
        self._left.pop(c, None)
        self._where[c] = addr
        if c in self._confirmed_once:
            resub.append(c)
        self._confirmed_once.add(c)
        for f in self._waiters.pop(c, []):
            if not f.done():
                f.set_result(None)

    def _lose(self, channels: Iterable[str], addr: Addr) -> None:
        for c in channels:
            if self._where.get(c) == addr:
                del self._where[c]
            if c in self._wanted:
                self._pending.add(c)
        self._stale = True
        self.stats["topology_changes"] += 1
        self._kick.set()

    def _on_unsolicited(self, conn: NodeConn, channel: str) -> None:
        log.info("unsolicited sunsubscribe of %s on %s", channel, conn.addr)
        self._left[channel] = (conn.addr, asyncio.get_running_loop().time() + self.settle_s)
        self._lose([channel], conn.addr)

    def _lagging(self, c: str, slot: int) -> bool:
        """The map still names as master of ``slot`` the node that unsubscribed us
        from ``c`` (within ``settle_s`` of it): the map has not caught up."""
        left = self._left.get(c)
        if left is None or self._map is None:
            return False
        node, until = left
        if asyncio.get_running_loop().time() >= until:
            del self._left[c]  # it really is the master again (or the map never learns)
            return False
        return self._map.node_for(slot) == node

    def _on_lost(self, conn: NodeConn, channels: set[str]) -> None:
        if self._conns.get(conn.addr) is conn:
            del self._conns[conn.addr]
        if self._closed:
            return
        self.stats["connections_lost"] += 1
        self._lose(channels, conn.addr)

    async def _refresh_map(self) -> None:
        seeds: list[Addr] = []
        if self._map is not None:
            seeds.extend(sorted(self._map.nodes()))
        seeds.extend(Addr(n.host, int(n.port)) for n in self.redis.get_nodes())
        last_exc: Exception | None = None
        best: SlotMap | None = None  # the most complete map, if no node gives a whole one
        for addr in dict.fromkeys(seeds):
            try:
                try:
                    reply = await raw_command(
                        addr, "CLUSTER", "SHARDS", auth=self._auth, tls=self._tls
                    )
                    m = parse_shards(reply, tls=self._tls is not None, asked=addr.host)
                except RedisCommandError:  # CLUSTER SLOTS answers a TLS client's port
                    reply = await raw_command(
                        addr, "CLUSTER", "SLOTS", auth=self._auth, tls=self._tls
                    )
                    m = parse_slots(reply, asked=addr.host)
            except (RedisUnavailable, RedisCommandError) as exc:
                last_exc = exc
                continue
            if not m.complete():  # a shard without a master now: ask the others first
                last_exc = RedisUnavailable(f"{addr}: slot map incomplete")
                if best is None or m.covered() > best.covered():
                    best = m
                continue
            best = m
            break
        if best is None or not best.covered():
            raise RedisUnavailable(f"no node gave a slot map: {last_exc!r}")
        # A partial map serves the shards that have a master; a channel of a masterless
        # slot stays pending (``node_for`` is None) and marks the map stale, so the
        # next round asks again until a replica has taken over.
        self._map = best
        self._stale = False
        self.stats["map_refreshes"] += 1

    async def _conn(self, addr: Addr) -> NodeConn:
        conn = self._conns.get(addr)
        if conn is not None and conn.alive:
            return conn
        conn = NodeConn(addr, self.on_message, self._on_unsolicited, self._on_lost)
        await conn.connect(self.client_name, self._auth, self.connect_timeout_s, self._tls)
        self._conns[addr] = conn
        return conn

    async def _sync_loop(self) -> None:
        """Make the actual subscriptions the wanted ones, whenever kicked. Raises when a
        round leaves wanted channels pending: the supervisor backs off and runs it again."""
        if self._pending & self._wanted:
            self._kick.set()  # started again after a failure: retry what is pending
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self._sync_once()
            except BaseException:
                self._stale = True
                raise
            left = len(self._pending & self._wanted)
            if left:
                raise RedisUnavailable(f"{left} channel(s) not subscribed yet")

    async def _sync_once(self) -> None:
        if self._stale or self._map is None:
            await self._refresh_map()
        assert self._map is not None
        todo = [c for c in self._pending if c in self._wanted]
        if not todo:
            return
        by_node: dict[Addr, list[str]] = {}
        lagging = False
        for c in todo:
            slot = slot_of(c)
            addr = self._map.node_for(slot, replica=self.read_from_replicas)
            if addr is None:  # nobody serves the slot yet (mid-failover)
                self._stale = True
                continue
            if self._lagging(c, slot):
                lagging = self._stale = True
                continue
            by_node.setdefault(addr, []).append(c)
        resub: list[str] = []
        results = await asyncio.gather(
            *(self._sync_node(addr, chans, resub) for addr, chans in by_node.items()),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                log.info("subscribe round failed: %r", r)
                self._stale = True
        if lagging:
            self.stats["stale_maps"] += 1
        if resub:
            self.stats["resubscribes"] += len(resub)
            self.on_resubscribed(resub)

    async def _sync_node(self, addr: Addr, chans: list[str], resub: list[str]) -> None:
        conn = await self._conn(addr)
        groups = group_by_slot(chans)
        futs = conn.ssubscribe(groups)
        self.stats["ssubscribe_commands"] += len(futs)
        await asyncio.wait(futs.values(), timeout=self.subscribe_timeout_s)
        for slot, fut in futs.items():
            if fut.done() and fut.exception() is None:
                for c in groups[slot]:
                    self._confirm(c, addr, resub)
            else:
                if fut.done():
                    log.info("SSUBSCRIBE slot %d on %s: %s", slot, addr, fut.exception())
                else:
                    fut.cancel()
                self._stale = True
