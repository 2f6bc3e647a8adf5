"""Presence: which relays have viewers of a session, for the workers' "nobody watches" rule.

Per watched session, the sorted set ``presence_key(sid)`` holds one member per relay with
local watchers; its score is when that entry expires, in Redis server milliseconds
(``TIME`` taken inside the script, so no host clock is involved: a relay whose clock is
off by seconds writes the same scores as any other). A worker counts the members whose
expiry is still ahead of the server's ``TIME`` (:func:`count_present`).

An entry lives :data:`PRESENCE_TTL_S` (30 s) and is refreshed every third of that. A
relay killed with ``kill -9`` removes nothing, and its screens would count until its
entries expire: the relays' heartbeats (:mod:`relay.broker.rediscluster.relays`) tell
the others within seconds, and each then refreshes every session it serves at once with
the dead relays' ids (:meth:`Presence.drop_dead`: their entries and screen counts go,
the corrected total is sent, below). The entries' TTL is what is left when the
heartbeats cannot be read.

A session is written when its first
local watcher opens and removed (``ZREM``) when its last one leaves; in between it is
refreshed every ``ttl_s / 3`` (with jitter, so refreshes spread over time), by one timer
that sends at most ``batch`` sessions per pipeline and yields between pipelines, so no
event-loop turn is spent on more than ``batch`` sessions (25: each script carries seven
keys since it also extends the session's keys and corrects its screen count, below; a
pipeline of 25 costs the client no more CPU than one of 50 did with the entry's key
alone).

Watching keeps a session alive: the same script that writes a relay's entry extends the
session's keys (its meta hash, backlog, chat history and history state) to at least the
lifetime its producer stored in the meta hash (``ttl``, seconds; at least the presence
entry's own TTL, so that a short session lifetime is still covered between refreshes),
with ``EXPIRE ... GT``: never shortened, never made volatile when it is not, and a key
that does not exist stays gone (an expired session is not brought back). A session
whose hash has no ``ttl`` (written before producers stored it) is not extended. So a
session expires its lifetime after its last write or the last refresh of a relay that
has viewers of it, whichever is later. It costs no round trip and no pipeline entry
more: one script per session per refresh, as before.

Screens: beside its entry, a relay writes how many screens it serves the session to,
in the hash ``screens_key(sid)`` (relay id -> count), when that number changes (the hub
debounces it and gathers the counts due together: :mod:`relay.edge.fanout.notices`),
with :func:`write_screens`: per session one script that writes this relay's field, sums
the fields of the relays whose presence entry is live, drops the others, and SPUBLISHes
the total as a ``presence`` frame on the session's live channel (offset 0, in no
backlog); the sessions of one call in one pipeline. Both writers send their scripts by
``EVALSHA`` (:func:`relay.broker.rediscluster.scripts.run_batch`). The refresh script
does the same correction: a field whose relay's entry expired (a relay that died) is
removed and the new total sent, so the count heals within the entry's TTL and one
refresh period. The hash
lives as long as the presence set.

The refresh timer is the supervised loop ``presence`` (:class:`relay.service.supervise.Supervisor`):
a failed pipeline puts its sessions back (nothing is dropped), the supervisor logs the
failure and starts the loop again after its jittered backoff.

Order of use::

    p = Presence(redis, relay_id="edge-1"); p.start(supervisor)
    p.add(sid)      # first local watcher of sid
    p.remove(sid)   # last local watcher of sid left
    await supervisor.stop(); await p.close()   # close removes every entry it wrote
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError, SessionDeleted
from relay.broker.rediscluster.scripts import (
    PRESENCE_COUNT,
    PRESENCE_WRITE,
    SCREENS,
    Call,
    run_batch,
)
from relay.protocol.keys import (
    KeyKind,
    gone_key,
    hist_key,
    key,
    live_channel,
    log_key,
    meta_key,
    presence_key,
    screens_key,
)

if TYPE_CHECKING:
    from relay.service.supervise import Supervisor

__all__ = [
    "COUNT_LUA",
    "DEAD_SLACK_MS",
    "PRESENCE_TTL_S",
    "WRITE_LUA",
    "Presence",
    "count_present",
    "dead_args",
    "write_keys",
    "write_screens",
]

WRITE_LUA: Final = PRESENCE_WRITE.source  # lua/presence_write.lua

COUNT_LUA: Final = PRESENCE_COUNT.source  # lua/presence_count.lua

# How long a relay's presence entry counts without a refresh (a dead relay's heartbeat
# stops long before: relay.broker.rediscluster.relays)
PRESENCE_TTL_S: Final = 30.0
# a dead relay's last write may come after its last beat: by this much (ms) at most
DEAD_SLACK_MS: Final = 3000


def write_keys(sid: str) -> tuple[str, ...]:
    """The keys of :data:`WRITE_LUA` for ``sid``: its presence, its screens hash and live
    channel (the count's correction), then its meta hash, then the other keys a watched
    session keeps alive (backlog, history, history state)."""
    return (presence_key(sid), screens_key(sid), live_channel(sid), meta_key(sid),
            log_key(sid), hist_key(sid), key(sid, KeyKind.HIST, "state"))  # fmt: skip


def dead_args(dead: Mapping[str, int], ttl_s: float, silent_s: float) -> tuple[str | int, ...]:
    """The scripts' last arguments for the relays ``dead`` (id -> when its heartbeat
    expired, server ms; a heartbeat lives ``silent_s``): per relay its id and the time by
    which an entry of its own expires if it was written before it went silent (its last
    beat, the entry's ``ttl_s`` and :data:`DEAD_SLACK_MS` for a write between its last
    beat and its death). One written later, by a relay back under the same id, stays."""
    out: list[str | int] = []
    for rid, expired in sorted(dead.items()):
        out += [rid, expired - int(silent_s * 1000) + int(ttl_s * 1000) + DEAD_SLACK_MS]
    return tuple(out)


async def write_screens(
    redis: RedisCluster, counts: Sequence[tuple[str, int]], relay_id: str, *,
    ttl_s: float = PRESENCE_TTL_S, dead: Mapping[str, int] | None = None,
    silent_s: float = 0.0,
) -> list[int | RelayError]:  # fmt: skip
    """For each ``(sid, count)``: this relay serves ``sid`` to ``count`` screens (0: none,
    its field goes); the session's total over the relays whose presence entry is live,
    also SPUBLISHed as a ``presence`` frame. One pipeline for all of them. ``ttl_s``: the
    presence entry's (an entry is made if this relay has none yet); ``dead``: relays
    taken for dead (silent ``silent_s``), whose entries and fields go. Per session its
    total, or what kept it from being written (:class:`SessionDeleted`: nothing written);
    raises :class:`RelayError` when the pipeline fails as a whole."""
    ttl_ms = int(ttl_s * 1000)
    gone = dead_args(dead or {}, ttl_s, silent_s)
    calls: list[Call] = [
        (SCREENS, (screens_key(sid), presence_key(sid), live_channel(sid), gone_key(sid)),
         (relay_id, count, sid, ttl_ms, *gone))
        for sid, count in counts
    ]  # fmt: skip
    out: list[int | RelayError] = []
    for (sid, _), reply in zip(counts, await run_batch(redis, calls), strict=True):
        if isinstance(reply, RelayError):
            out.append(reply)
        elif int(reply) < 0:
            out.append(SessionDeleted(sid))
        else:
            out.append(int(reply))
    return out


async def count_present(redis: RedisCluster, sid: str) -> int:
    """Relays whose presence entry for ``sid`` has not expired (Redis server time)."""
    return int(await PRESENCE_COUNT(redis, (presence_key(sid),), ()))


class Presence:
    """Presence entries of one relay. See the module docstring."""

    def __init__(
        self,
        redis: RedisCluster,
        relay_id: str,
        *,
        ttl_s: float = PRESENCE_TTL_S,
        batch: int = 25,
        tick_s: float | None = None,
    ) -> None:
        # due refreshes are written every tick (new and gone entries at once): a tick of
        # a thirtieth of the TTL (1 s for 30 s) fills pipelines instead of sending a few
        # sessions ten times a second, and leaves two thirds of the TTL to spare
        tick_s = min(1.0, ttl_s / 30) if tick_s is None else tick_s
        if ttl_s <= 0 or batch < 1 or tick_s <= 0:
            raise ValueError("presence ttl, batch and tick must be positive")
        self.redis = redis
        self.relay_id = relay_id
        self.ttl_s = ttl_s
        self.batch = batch
        self.tick_s = tick_s
        self._watched: dict[str, float] = {}  # sid -> when its next refresh is due
        self._due: list[tuple[float, str]] = []  # heap; stale entries skipped
        self._new: set[str] = set()
        self._gone: set[str] = set()
        self._kick = asyncio.Event()
        self._dead: tuple[str | int, ...] = ()  # relays taken for dead: entries go ...
        self._purging: set[str] = set()  # ... in these sessions' next refresh
        self.stats: dict[str, int] = {"presence_writes": 0, "presence_errors": 0}

    @property
    def refresh_s(self) -> float:
        return self.ttl_s / 3

    def start(self, supervisor: Supervisor) -> None:
        # critical: entries that are not refreshed expire, and workers then treat this
        # relay's viewers as gone ("nobody watches"); a relay that cannot write presence
        # must not take viewers
        supervisor.forever("presence", self._loop, critical=True)

    async def close(self) -> None:
        """Remove every entry this relay wrote. Stop the supervisor that runs the refresh
        loop first: a refresh racing this would write entries back."""
        self._gone.update(self._watched)
        self._watched.clear()
        self._new.clear()
        with contextlib.suppress(RelayError):
            await self._flush(0.0)

    def add(self, sid: str) -> None:
        if sid in self._watched:
            return
        self._gone.discard(sid)
        self._watched[sid] = 0.0
        self._new.add(sid)
        self._kick.set()

    def drop_dead(self, dead: Mapping[str, int], silent_s: float) -> None:
        """Relays ``dead`` died (id -> when its heartbeat, of ``silent_s``, expired):
        every session this relay serves is refreshed now, and its refresh removes their
        entries and screen counts (and sends the corrected total)."""
        self._dead = dead_args(dead, self.ttl_s, silent_s)
        self._purging = set(self._watched)
        self.rewrite()

    def rewrite(self) -> None:
        """Every entry written again now (others may have taken this relay for dead)."""
        self._new.update(self._watched)
        self._kick.set()

    def remove(self, sid: str) -> None:
        if self._watched.pop(sid, None) is None:
            return
        self._new.discard(sid)
        self._gone.add(sid)
        self._kick.set()

    async def _loop(self) -> None:
        """Write new entries at once, refresh due ones every tick; a failed write raises
        (after putting its sessions back) and the supervisor starts this again."""
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._kick.wait()
            self._kick.clear()
            await self._flush(loop.time())

    def _schedule(self, sid: str, now: float) -> None:
        due = now + self.refresh_s * random.uniform(0.8, 1.0)
        self._watched[sid] = due
        heapq.heappush(self._due, (due, sid))

    async def _flush(self, now: float) -> None:
        writes = list(self._new)
        self._new.clear()
        while self._due and self._due[0][0] <= now:
            due, sid = heapq.heappop(self._due)
            if self._watched.get(sid) == due:
                writes.append(sid)
        for sid in writes:
            if sid in self._watched:
                self._schedule(sid, now)
        gone = list(self._gone)
        self._gone.clear()
        for i in range(0, max(len(writes), len(gone)), self.batch):
            batch = (writes[i : i + self.batch], gone[i : i + self.batch])
            try:
                await self._write(*batch)
            except RelayError:  # written again on the next run: nothing is dropped
                self.stats["presence_errors"] += 1
                self._new.update(s for s in writes[i:] if s in self._watched)
                self._gone.update(s for s in gone[i:] if s not in self._watched)
                raise
            self.stats["presence_writes"] += len(batch[0])
            await asyncio.sleep(0)

    async def _write(self, writes: list[str], gone: list[str]) -> None:
        """One pipeline: entries written (and their sessions' keys extended), entries
        removed; a failure raises :class:`relay.broker.errors.RelayError`."""
        ttl_ms = int(self.ttl_s * 1000)
        # built per write, not kept per watched session: seven key names (about 700
        # bytes) for every session, against a few microseconds per session every refresh_s
        calls: list[Call] = [
            (PRESENCE_WRITE, write_keys(sid),
             (self.relay_id, ttl_ms, sid, *(self._dead if sid in self._purging else ())))
            for sid in writes
        ]  # fmt: skip
        zrems = [("ZREM", presence_key(sid), self.relay_id) for sid in gone]
        for reply in await run_batch(self.redis, calls, zrems):
            if isinstance(reply, RelayError):
                raise reply
        self._purging.difference_update(writes)
