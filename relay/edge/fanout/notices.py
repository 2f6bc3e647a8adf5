"""The frames of a session that are outside its order: offset 0, never a duplicate or a
gap, never a resume point; and this relay's screen counts, which make one of them.

- **The deleted notice** (:func:`relay.protocol.frame.deleted_frame`: a ``reset`` with
  ``meta.code`` ``session_deleted``): the producer that deleted a session SPUBLISHes it;
  the hub recognises it (:func:`is_deleted`) and ends the session's streams with it
  (:meth:`relay.edge.fanout.hub.Hub._gone`); a relay that learns the deletion from a read
  instead makes its own (:func:`deleted_delivery`).
- **The presence frame** (``kind`` ``presence``, ``meta.screens``: how many screens
  watch the session, over every relay). :class:`PresenceWriter` keeps, per session this relay
  serves, the count it last wrote; when the number of the session's local connections
  changes, it writes the new one through :meth:`relay.broker.base.Broker.screens` (per
  session one script: this relay's field, the live relays' total, the frame SPUBLISHed)
  once the change has held for ``settle_s`` (half the interval, at most
  :data:`SETTLE_S`: a screen that drops and reconnects within it changes nothing, so a
  reconnect storm writes no count), at most once per ``interval_s`` per session, one
  write in flight per session (a change meanwhile is written once the write is back,
  with the count of that moment). The writes that fall due in one tick
  (:data:`TICK_S`) go to the broker together, in batches of :data:`BATCH` (one pipeline
  each: a storm of changes costs a few round trips, not one task and one round trip per
  session). The frame comes back
  on the session's channel like any other, to every relay that serves it;
  :meth:`PresenceWriter.received` hands it to each local connection
  (:meth:`relay.edge.fanout.channel.Watcher.notice`, outside the session's order) and
  keeps it on the channel, so that a screen that opens later gets the count at once
  (:meth:`PresenceWriter.joined`). Nothing here runs per token: a count changes when a screen
  comes or goes.

Order of use (the hub)::

    screens = PresenceWriter(broker, count, spawn, interval_s=1.0, counters=hub.counters)
    screens.joined(ch, w)          # a connection of ch's session opened here
    screens.changed(sid)           # one closed
    screens.received(ch, d)        # a presence frame of ch's session arrived
    screens.forget(sid)            # the session was deleted
    screens.recount()              # others dropped this relay's counts: all written again
    await screens.close()          # the relay stops: its fields written as 0
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any, Final

from relay.broker.base import Broker
from relay.broker.errors import RelayError, SessionDeleted
from relay.edge.core.resume import Delivery
from relay.edge.fanout.channel import Channel, Watcher
from relay.protocol import sse
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, deleted_frame, encode

__all__ = [
    "BATCH",
    "CLOSE_WRITES_S",
    "DELETED_REASON",
    "SETTLE_S",
    "TICK_S",
    "PresenceWriter",
    "deleted_delivery",
    "is_deleted",
]

log = logging.getLogger(__name__)

DELETED_REASON: Final = "the session was deleted"
CLOSE_WRITES_S: Final = 2.0  # how long a closing relay spends writing its counts as 0
SETTLE_S: Final = 0.5  # the longest a change must hold before it is written
TICK_S: Final = 0.05  # writes due within one tick go together
BATCH: Final = 50  # sessions per call of Broker.screens (4 keys each)


def is_deleted(f: Frame) -> bool:
    """The notice of a deleted session (:func:`relay.protocol.frame.deleted_frame`)."""
    return (
        f.kind == "reset" and f.meta is not None and f.meta.get("code") == CloseCode.SESSION_DELETED
    )


def deleted_delivery(sid: str) -> Delivery:
    """The relay's own deleted notice, for a deletion found by a read (the producer's
    notice did not reach this relay)."""
    return Delivery(0, "reset", encode(deleted_frame(sid)))


class PresenceWriter:
    """This relay's screen counts, written when they change. See the module docstring.

    ``count(sid)``: the session's local connections now; ``spawn``: runs a write as a
    task (the hub's supervisor); ``interval_s`` <= 0: no counts are written and no
    presence frame is handed on."""

    def __init__(
        self,
        broker: Broker,
        count: Callable[[str], int],
        spawn: Callable[[str, Coroutine[Any, Any, None]], object],
        *,
        interval_s: float = 1.0,
        counters: MutableMapping[str, int] | None = None,
    ) -> None:
        self.broker = broker
        self.count = count
        self.spawn = spawn
        self.interval_s = interval_s
        self.settle_s = min(SETTLE_S, interval_s / 2)
        self._tick = min(TICK_S, self.settle_s) or TICK_S
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        for k in ("screens_writes", "screens_errors", "presence_frames"):
            self.counters.setdefault(k, 0)
        self._sent: dict[str, int] = {}  # sid -> the count written last (absent: 0)
        self._at: dict[str, float] = {}  # sid -> when it was written (loop time)
        self._due: dict[str, asyncio.TimerHandle] = {}  # a write waiting for its time
        self._ready: dict[str, None] = {}  # due now: in the next batch (in order)
        self._send: asyncio.Handle | None = None  # the next batch, scheduled
        self._busy: set[str] = set()  # a write in flight
        self._force: set[str] = set()  # written even if unchanged (recount)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    # -- what the hub tells it ---------------------------------------------------------

    def joined(self, ch: Channel, w: Watcher) -> None:
        """A connection of ``ch``'s session opened here: the count known, at once; the
        new count, written soon."""
        if not self.enabled:
            return
        if ch.presence is not None:
            w.notice(ch.presence)
        self.changed(ch.sid)

    def changed(self, sid: str) -> None:
        """The session's local connections changed: write the count once the change has
        held for ``settle_s`` and the last write is ``interval_s`` old, on a tick."""
        if not self.enabled or sid in self._due or sid in self._busy or sid in self._ready:
            return  # the write due (or the one after the write in flight) reads it then
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = max(self._at.get(sid, -self.interval_s) + self.interval_s, now + self.settle_s)
        at = math.ceil(at / self._tick) * self._tick  # the writes of one tick go together
        self._due[sid] = loop.call_at(at, self._write_due, sid)

    def received(self, ch: Channel, d: Delivery) -> None:
        """A presence frame of ``ch``'s session: to every local connection, and kept for
        the ones that open later. Its SSE event has no ``id:`` (a client's resume point
        is not touched)."""
        if not self.enabled:
            return
        self.counters["presence_frames"] += 1
        d.sse = sse.event(d.data, kind="presence")
        ch.presence = d
        for w in ch.watchers():
            w.notice(d)

    def recount(self) -> None:
        """Every count this relay wrote is written again, unchanged or not (the others
        took this relay for dead while it stalled, and dropped its counts)."""
        for sid in list(self._sent):
            self._force.add(sid)
            self.changed(sid)

    def forget(self, sid: str) -> None:
        """The session was deleted: nothing more is written for it."""
        handle = self._due.pop(sid, None)
        if handle is not None:
            handle.cancel()
        self._ready.pop(sid, None)
        self._sent.pop(sid, None)
        self._at.pop(sid, None)
        self._force.discard(sid)

    async def close(self) -> None:
        """The relay stops: every count it wrote goes back to 0 (bounded by
        :data:`CLOSE_WRITES_S`; what is left expires with its presence entry)."""
        for handle in self._due.values():
            handle.cancel()
        self._due.clear()
        self._ready.clear()
        if self._send is not None:
            self._send.cancel()
            self._send = None
        sids = [sid for sid, n in self._sent.items() if n]
        self._sent.clear()
        if not sids:
            return
        writes = [self.broker.screens(b) for b in _batches([(sid, 0) for sid in sids])]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WRITES_S):
                await asyncio.gather(*writes, return_exceptions=True)

    # -- the writes ----------------------------------------------------------------------

    def _write_due(self, sid: str) -> None:
        self._due.pop(sid, None)
        self._ready[sid] = None
        if self._send is None:  # after every timer of this tick has fired
            self._send = asyncio.get_running_loop().call_soon(self._send_ready)

    def _send_ready(self) -> None:
        """The counts due now that differ from the ones written, in batches."""
        self._send = None
        items: list[tuple[str, int]] = []
        for sid in self._ready:
            n = self.count(sid)
            if sid in self._force:
                self._force.discard(sid)
            elif n == self._sent.get(sid, 0):
                if not n:  # nothing is left of the session here
                    self._at.pop(sid, None)
                continue
            self._busy.add(sid)
            items.append((sid, n))
        self._ready.clear()
        for batch in _batches(items):
            self.spawn("screens", self._write(batch))

    async def _write(self, items: list[tuple[str, int]]) -> None:
        """One batch; then, for each session whose count moved meanwhile (or whose write
        failed), the next write, ``interval_s`` later."""
        try:
            replies = await self.broker.screens(items)
        except RelayError as exc:  # none written: each tried again after the interval
            replies = [exc] * len(items)
        finally:
            now = asyncio.get_running_loop().time()
            for sid, _ in items:
                self._busy.discard(sid)
                self._at[sid] = now
        failed = 0
        for (sid, n), reply in zip(items, replies, strict=True):
            if isinstance(reply, SessionDeleted):  # the deleted notice ends the streams
                self.forget(sid)
                continue
            if isinstance(reply, RelayError):  # tried again while it differs
                failed += 1
                if failed == 1:
                    log.info("screen count of %s not written: %s", sid, reply)
            else:
                self.counters["screens_writes"] += 1
                if n:
                    self._sent[sid] = n
                else:
                    self._sent.pop(sid, None)
            if not n or self.count(sid) != self._sent.get(sid, 0):
                self.changed(sid)  # the next write; after a 0, the check that forgets it
        self.counters["screens_errors"] += failed


def _batches(items: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``items`` in calls of :data:`BATCH` sessions at most."""
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
