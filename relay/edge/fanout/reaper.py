"""The reaper: end a watched turn whose worker died, once, whichever relay gets there first.

A watched channel whose turn is open (its last frame was not ``done``/``error``) and
silent for ``reap_after_s`` gets :func:`relay.broker.rediscluster.publisher.reap`: once the
worker's turn lock has expired, the turn ends with an ``error`` frame "worker lost". Every
``interval_s`` the reaper looks at the channels the hub hands it (``channels()``), at
most one reap in flight per channel, then not before the next interval.

The interval is the supervised loop ``reaper``; each reap is a task of the same
:class:`relay.service.supervise.Supervisor` (a failure is logged, the channel is tried
again after the next interval).

Order of use::

    r = Reaper(redis, relay_id, channels=hub_channels); r.start(supervisor)
    ...                        # the hub keeps each channel's ReapState up to date
    await supervisor.stop()    # ends the loop and the reaps in flight
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError
from relay.broker.rediscluster.publisher import ReapStatus, reap
from relay.edge.core.resume import Delivery
from relay.service.supervise import Supervisor

__all__ = ["ReapState", "Reaper"]

log = logging.getLogger(__name__)


class ReapState:
    """What the reaper needs of one watched channel; the hub calls :meth:`saw`."""

    __slots__ = ("last_frame", "reap_next", "reaping", "sid", "turn_open")

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.turn_open = True  # a turn may be open until a done/error frame says otherwise
        self.last_frame = time.monotonic()
        self.reap_next = 0.0
        self.reaping = False

    def saw(self, ds: list[Delivery], now: float) -> None:
        """Frames were delivered at ``now`` (``time.monotonic()``)."""
        for d in ds:
            self.saw_one(d, now)

    def saw_one(self, d: Delivery, now: float) -> None:
        kind = d.kind
        if kind == "token" or kind == "meta":
            self.turn_open = True
        elif kind == "done" or kind == "error":
            self.turn_open = False
        self.last_frame = now


class Reaper:
    """See the module docstring. ``channels()``: the watched, subscribed channels now."""

    def __init__(
        self,
        redis: RedisCluster,
        relay_id: str,
        channels: Callable[[], Iterable[ReapState]],
        *,
        reap_after_s: float = 2.0,
        interval_s: float = 1.0,
        maxlen: int = 10_000,
        ttl_s: int = 86_400,
    ) -> None:
        self.redis = redis
        self.relay_id = relay_id
        self.channels = channels
        self.reap_after_s = reap_after_s
        self.interval_s = interval_s
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.stats: dict[str, int] = {"reap_checks": 0, "reaped": 0, "reap_errors": 0}
        self._supervisor: Supervisor | None = None

    def start(self, supervisor: Supervisor) -> None:
        """Run on ``supervisor`` (0 ``interval_s``: never)."""
        if self.interval_s <= 0:
            return
        self._supervisor = supervisor
        # not critical: a relay that cannot reap still streams every live frame; only
        # turns whose worker died stay open longer (and the reaps of other relays that
        # watch the same sessions still end them)
        supervisor.every(
            "reaper", self.interval_s, self._tick, critical=False, first_delay_s=self.interval_s
        )

    async def _tick(self) -> None:
        assert self._supervisor is not None
        now = time.monotonic()
        for ch in list(self.channels()):
            if (
                ch.turn_open
                and not ch.reaping
                and now - ch.last_frame >= self.reap_after_s
                and now >= ch.reap_next
            ):
                ch.reaping = True
                self._supervisor.spawn(f"reap:{ch.sid}", self._reap(ch))

    async def _reap(self, ch: ReapState) -> None:
        self.stats["reap_checks"] += 1
        try:
            res = await reap(
                self.redis, ch.sid, reaper=self.relay_id, maxlen=self.maxlen, ttl_s=self.ttl_s
            )
        except RelayError:  # logged by the supervisor; tried again after the interval
            self.stats["reap_errors"] += 1
            raise
        else:
            if res.status is ReapStatus.IDLE:
                ch.turn_open = False  # until the next token/meta frame
            elif res.status is ReapStatus.REAPED:
                self.stats["reaped"] += 1
                log.warning("session %s: turn %d reaped (worker lost)", ch.sid, res.turn)
        finally:
            ch.reaping = False
            ch.reap_next = time.monotonic() + self.interval_s
