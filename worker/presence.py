"""Presence-driven cancellation: stop generating for a session nobody watches.

The relay (``relay/hub.py``) keeps, per session with watchers, a sorted set
``presence_key(sid)``: member = relay id, score = last-seen Unix milliseconds, refreshed
about once a second. While a turn generates, the worker looks at it off the hot path:

* :class:`PresenceTracker` — the pure rule. The grace timer starts at turn start (the
  viewer that POSTed may not have connected yet); every observation that finds a watcher
  resets it; when ``grace_s`` passes with no watcher the verdict is ``abandoned``. A
  viewer that comes back within the grace period simply resumes from the backlog.
* :func:`count_watchers` — one ``ZCOUNT presence_key(sid) (now - window_ms) +inf``: relays
  seen within the last ``window_s`` seconds (a few refresh periods, which also absorbs
  clock skew between pods).
* :func:`watch_presence` — the loop the turn runner starts as a task: every
  ``interval_s`` it counts watchers, feeds the tracker and, on ``abandoned``, calls
  ``on_abandoned()`` and returns; it also returns once its ``stop`` event is set (the
  turn ended). A Redis error counts as "watched" (never cancel a turn because the
  control read failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from relay.errors import RelayError, map_redis_errors
from relay.keys import presence_key

__all__ = ["PresencePolicy", "PresenceTracker", "count_watchers", "watch_presence"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PresencePolicy:
    """``grace_s``: how long a turn may generate unwatched; ``interval_s``: how often the
    worker looks; ``window_s``: how recent a relay's last-seen must be to count."""

    grace_s: float = 10.0
    interval_s: float = 1.0
    window_s: float = 3.0

    def __post_init__(self) -> None:
        if self.grace_s <= 0 or self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("presence grace, interval and window must be positive")


class PresenceTracker:
    """The pure grace rule for one turn (the caller passes monotonic times)."""

    def __init__(self, grace_s: float, started: float) -> None:
        self.grace_s = grace_s
        self.last_watched = started
        self.ever_watched = False

    def observe(self, now: float, watchers: int) -> bool:
        """Record one observation; return True when the turn is abandoned."""
        if watchers > 0:
            self.last_watched = now
            self.ever_watched = True
            return False
        return now - self.last_watched >= self.grace_s

    def unwatched_for(self, now: float) -> float:
        return max(0.0, now - self.last_watched)


async def count_watchers(redis: RedisCluster, sid: str, window_s: float) -> int:
    """Relays that reported watchers of ``sid`` within the last ``window_s`` seconds."""
    floor_ms = time.time_ns() // 1_000_000 - int(window_s * 1000)
    with map_redis_errors():
        return int(await redis.zcount(presence_key(sid), f"({floor_ms}", "+inf"))


async def watch_presence(
    redis: RedisCluster,
    sid: str,
    policy: PresencePolicy,
    on_abandoned: Callable[[], Awaitable[None] | None],
    *,
    on_tick: Callable[[], Awaitable[None]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    stop: asyncio.Event | None = None,
    local_watchers: Callable[[], int] | None = None,
) -> None:
    """Run until the turn is abandoned (then call ``on_abandoned`` and return), until
    ``stop`` is set or until cancelled. ``on_tick`` runs every interval too (the turn
    runner refreshes its lock). ``local_watchers`` counts viewers attached to this very
    process (the worker's closed loop), which no relay reports.

    ``stop`` is checked after every await: a cancellation can be lost when it lands on a
    Redis call whose reply arrives in the same loop iteration (seen after a master
    stall), and the loop must end anyway, or the turn never ends and its lock lives on."""
    tracker = PresenceTracker(policy.grace_s, clock())

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    while not stopped():
        await asyncio.sleep(policy.interval_s)
        if stopped():
            return
        if on_tick is not None:
            await on_tick()
        if stopped():
            return
        try:
            watchers = await count_watchers(redis, sid, policy.window_s)
        except RelayError as exc:
            _log.warning("presence check of %s failed: %s", sid, exc)
            watchers = 1
        if stopped():
            return
        if local_watchers is not None:
            watchers += local_watchers()
        if tracker.observe(clock(), watchers):
            res = on_abandoned()
            if res is not None:
                await res
            return
