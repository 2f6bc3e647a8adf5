"""The reaper: end a watched turn whose producer died, once, whichever relay gets there first.

A watched channel whose turn is open (its last frame was not ``done``/``error``) and
silent for ``reap_after_s`` gets :meth:`relay.broker.base.Broker.reap`: once the
producer's turn lock has expired, the turn ends with an ``error`` frame "worker lost"
(on Redis, one script on the session's slot, so any number of relays may race). Every
``interval_s`` the reaper looks at the channels the hub hands it (``channels()``, each a
:class:`Reapable`), at most one reap in flight per channel, then not before the next
interval.

The interval is the supervised loop ``reaper``; each reap is a task of the same
:class:`relay.service.supervise.Supervisor` (a failure is logged, the channel is tried
again after the next interval).

Order of use::

    r = Reaper(broker, channels=hub_channels); r.start(supervisor)
    ...                        # the hub keeps each channel's fields up to date
    await supervisor.stop()    # ends the loop and the reaps in flight
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from relay.broker.base import Broker, ReapStatus
from relay.broker.errors import RelayError
from relay.service.supervise import Supervisor

__all__ = ["Reapable", "Reaper"]

log = logging.getLogger(__name__)


class Reapable(Protocol):
    """What the reaper reads and writes of one watched channel (the hub's channels)."""

    sid: str
    turn_open: bool  # a turn may be open: no done/error frame since its last token/meta
    last_frame: float  # time.monotonic() of its last frame
    reap_next: float  # not before then
    reaping: bool  # a reap is in flight


class Reaper:
    """See the module docstring. ``channels()``: the watched, subscribed channels now."""

    def __init__(
        self,
        broker: Broker,
        channels: Callable[[], Iterable[Reapable]],
        *,
        reap_after_s: float = 2.0,
        interval_s: float = 1.0,
    ) -> None:
        self.broker = broker
        self.channels = channels
        self.reap_after_s = reap_after_s
        self.interval_s = interval_s
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

    async def _reap(self, ch: Reapable) -> None:
        self.stats["reap_checks"] += 1
        try:
            res = await self.broker.reap(ch.sid)
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
