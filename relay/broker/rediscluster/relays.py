"""The relays' heartbeats: how a relay learns, within seconds, that another one died.

A relay killed with ``kill -9`` removes nothing: its presence entries live their TTL
(:mod:`relay.broker.rediscluster.presence`) and its screen counts count meanwhile, so the
screens of its sessions, reconnected to other relays, are told too many. Every relay
therefore beats every :data:`BEAT_S` (1 s) in one sorted set of the cluster,
``RELAYS_REGISTRY`` (relay id -> when its heartbeat expires, Redis server ms: no host
clock), with one script, ``lua/relays.lua``, that also returns the relays whose
heartbeat expired (:data:`BEAT_TTL_S`, 5 s, after their last beat). A relay that learns
of a new one hands it to ``on_dead`` (id -> when its heartbeat expired, server ms):
the presence refresh of every session it serves runs at once with them
(``presence_write.lua`` removes their entries and screen counts and sends the corrected
total). So every screen's count is right again about
``BEAT_TTL_S + BEAT_S`` after a relay's death (6 s and a pipeline), for one script per
relay per second, whatever the number of sessions; the entries' own TTL is what is left
when the heartbeats cannot be read.

A relay taken for dead that was only stalled (its event loop, or its way to Redis, for
longer than :data:`BEAT_TTL_S`) learns it from its next beat (``lapsed``) and hands it to
``on_lapsed``: it writes its screen counts and presence entries again, which the others
may have dropped. A stopped relay stays listed :data:`KEEP_S` and then goes; a relay
that stops cleanly removes its own beat (it wrote its counts back to 0).

The loop is the supervised ``relays`` (not critical: without it a dead relay's screens
count until its presence entries expire, as before). Order of use::

    beats = Heartbeats(redis, "edge-1", on_dead=..., on_lapsed=...)
    beats.start(supervisor)
    ...
    await supervisor.stop(); await beats.close()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError
from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.scripts import RELAYS
from relay.protocol.keys import RELAYS_REGISTRY

if TYPE_CHECKING:
    from relay.service.supervise import Supervisor

__all__ = ["BEAT_S", "BEAT_TTL_S", "KEEP_S", "MAX_DEAD", "Heartbeats"]

BEAT_S: Final = 1.0  # how often a relay beats
BEAT_TTL_S: Final = 5.0  # a relay whose last beat is this old is taken for dead
KEEP_S: Final = 600.0  # how long a dead relay stays listed (every relay hears of it)
MAX_DEAD: Final = 32  # dead relays read per beat at most (the oldest first)


class Heartbeats:
    """This relay's heartbeat and the others' deaths. See the module docstring."""

    def __init__(
        self,
        redis: RedisCluster,
        relay_id: str,
        *,
        on_dead: Callable[[Mapping[str, int]], None],
        on_lapsed: Callable[[], None],
        beat_s: float = BEAT_S,
        ttl_s: float = BEAT_TTL_S,
    ) -> None:
        if beat_s <= 0 or ttl_s <= beat_s:
            raise ValueError("heartbeats need 0 < beat_s < ttl_s")
        self.redis = redis
        self.relay_id = relay_id
        self.on_dead = on_dead
        self.on_lapsed = on_lapsed
        self.beat_s = beat_s
        self.ttl_s = ttl_s
        # the relays taken for dead, as last read: id -> when its heartbeat expired (ms)
        self.dead: dict[str, int] = {}
        self.beats = 0
        self.stats: dict[str, int] = {"relay_beats": 0, "relays_dead": 0, "relay_lapses": 0}

    def start(self, supervisor: Supervisor) -> None:
        supervisor.forever("relays", self._loop, critical=False)

    async def close(self) -> None:
        """Leave the set: a relay that stops cleanly is not a dead one."""
        with contextlib.suppress(RelayError), map_redis_errors():
            await self.redis.zrem(RELAYS_REGISTRY, self.relay_id)

    async def beat(self) -> None:
        """One beat: this relay's, and what it tells (new deaths, a lapse of its own)."""
        reply = await RELAYS(
            self.redis, (RELAYS_REGISTRY,),
            (self.relay_id, int(self.ttl_s * 1000), int(KEEP_S * 1000), MAX_DEAD),
        )  # fmt: skip
        lapsed = int(reply[0]) == 1 and self.beats > 0  # a first beat finds none: not one
        pairs = [x.decode() if isinstance(x, bytes) else str(x) for x in reply[1:]]
        dead = {rid: int(float(at)) for rid, at in zip(pairs[::2], pairs[1::2], strict=True)}
        dead.pop(self.relay_id, None)
        self.beats += 1
        self.stats["relay_beats"] += 1
        new = {rid: at for rid, at in dead.items() if rid not in self.dead}
        self.dead = dead
        if new:
            self.stats["relays_dead"] += len(new)
            self.on_dead(new)
        if lapsed:
            self.stats["relay_lapses"] += 1
            self.on_lapsed()

    async def _loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.beat_s)
