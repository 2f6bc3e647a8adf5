"""Presence-driven cancellation: stop generating for a session nobody watches.

The relay (:mod:`relay.broker.rediscluster.presence`) keeps, per session with watchers, a sorted set
``presence_key(sid)``: member = relay id, score = when that entry expires in Redis server
milliseconds (written when the relay's first watcher opens, refreshed every third of its
TTL, removed when the last watcher leaves). While a turn generates, the worker looks at
it off the hot path:

* :class:`PresenceTracker` — the pure rule. The grace timer starts at turn start (the
  viewer that POSTed may not have connected yet); every observation that finds a watcher
  resets it; when ``grace_s`` passes with no watcher the verdict is ``abandoned``. A
  viewer that comes back within the grace period simply resumes from the backlog.
* :func:`present_relays` — relays whose entry has not expired, compared with Redis
  server ``TIME`` inside a script (:meth:`relay.broker.port.TurnStore.viewers`; on Redis
  :func:`relay.broker.rediscluster.presence.count_present`): no host clock is involved, so
  clock skew between pods changes nothing.
* :func:`follow_presence` — the loop the turn runner starts as a supervised task
  (:meth:`relay.service.supervise.Supervisor.spawn`: a failure is logged): every
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

from relay.broker.errors import RelayError
from relay.broker.port import TurnStore

__all__ = ["PresencePolicy", "PresenceTracker", "follow_presence", "present_relays"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PresencePolicy:
    """``grace_s``: how long a turn may generate unwatched; ``interval_s``: how often the
    worker looks. How long a relay's entry counts is the relay's to say (its TTL)."""

    grace_s: float = 10.0
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.grace_s <= 0 or self.interval_s <= 0:
            raise ValueError("presence grace and interval must be positive")


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


async def present_relays(store: TurnStore, sid: str) -> int:
    """Relays with watchers of ``sid`` now (entries not expired, by the store's clock)."""
    return await store.viewers(sid)


async def follow_presence(
    store: TurnStore,
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
            watchers = await present_relays(store, sid)
        except RelayError as exc:
            log.warning("presence check of %s failed: %s", sid, exc)
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
