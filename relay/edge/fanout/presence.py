"""Presence (how many screens watch a session) for readers that take its frames outside
the hub: viewer accounting.

Every reader of a session counts as a viewer, whatever its front: the producer stops
a turn that nobody watches (``no_viewers``, :mod:`relay.producer.presence`), and it knows
who watches from the hub's presence and screen counts, which count the hub's watchers.
SSE, WebSocket, the UI message stream and the Responses stream are connections the hub
feeds (:class:`relay.edge.conn.base.Conn`), so they are counted by being opened. A
front that reads the session's frames from the store itself (the Durable Streams view
of a session, :mod:`relay.durable.sessions`, which re-reads the backlog on each
wake-up) registers a :class:`Viewer` for as long as its reader waits for more: the hub
counts it like a connection (presence, screens, the reaper) and feeds it nothing.

Order of use::

    async with viewing(hub, sid):   # counted from here (subscribed, present)
        ...                         # the front's own live read
    # no longer counted (the hub's last watcher leaving marks the session absent)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.protocol.codes import CloseCode

__all__ = ["Viewer", "viewing"]


class Viewer:
    """A :class:`relay.edge.fanout.channel.Watcher` that is counted and fed nothing:
    live only (no replay), its frames come to its front by another way."""

    __slots__ = ("_closed", "offset", "sid", "stop")

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.offset: int | None = None
        self.stop: tuple[CloseCode, str] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def subscribed(self) -> None:
        """Nothing to replay: the front reads the backlog itself."""

    async def first_read(self) -> None:
        """No backlog bounds to wait for."""

    def feed(self, ds: list[Delivery]) -> None:
        """Live frames reach the front through its own wake-ups."""

    def notice(self, d: Delivery) -> None:
        """Presence frames are not part of the front's wire."""

    def shut(self, reason: str, code: CloseCode) -> None:
        if not self._closed:
            self._closed = True
            self.stop = self.stop or (code, reason)

    def farewell(self, d: Delivery, reason: str, code: CloseCode) -> None:
        """The session was deleted: the front's next read finds it gone."""
        self.shut(reason, code)


@contextlib.asynccontextmanager
async def viewing(hub: Hub, sid: str) -> AsyncIterator[Viewer]:
    """``sid`` counted as watched by one more viewer on ``hub`` until the block ends.

    Raises what :meth:`relay.edge.fanout.hub.Hub.open` raises (the channel could not be
    subscribed, the session was deleted, the relay shuts down)."""
    v = Viewer(sid)
    try:
        await hub.open(v)
        yield v
    finally:
        v.shut("the reader left", CloseCode.CLOSED)
        hub.conn_closed(v)
