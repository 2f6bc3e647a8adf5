"""A connection with no socket: a session's frames for code in this process.

Tests, benchmarks and tools watch a session through the same fan-out, replay and
cutoff as a browser does: a :class:`Reader` is a :class:`relay.edge.conn.base.Conn`
whose frames are taken with ``await reader.next()`` instead of written to a socket.

Order of use::

    r = await open_reader(hub, sid, from_offset, gen)  # None: live only; 0: the whole backlog
    # (notices=True: the presence frames too, among the others, offset 0)
    while True: deliveries = await r.next()      # raises WatchClosed(reason, code)
    await r.close()
"""

from __future__ import annotations

from typing import Any, ClassVar

from relay.broker.errors import WatchClosed
from relay.edge.conn.base import READER, Conn
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.protocol.codes import CloseCode

__all__ = ["Reader", "open_reader"]


class Reader(Conn):
    """A session's frames for code in this process. See the module docstring.

    ``notices``: also the frames outside the session's order (the presence count); by
    default a reader takes the session's frames only."""

    transport_kind: ClassVar[str] = READER

    __slots__ = ("_notices",)

    def __init__(self, hub: Hub, sid: str, offset: int | None, gen: str | None = None,
                 *, notices: bool = False, **kw: Any) -> None:  # fmt: skip
        super().__init__(hub, sid, offset, gen, **kw)
        self._notices = notices

    def notice(self, d: Delivery) -> None:
        if self._notices:
            super().notice(d)

    async def next(self) -> list[Delivery]:
        """Wait for at least one frame; return everything queued, in order. Once the
        watch is closed: its last frame if it had one (a deleted session's notice),
        then :class:`WatchClosed`."""
        w = self.watch
        while True:
            closed = w.closed
            if closed is not None:
                last, self._farewell = self._farewell, None
                if last is not None:
                    return [last]
                raise WatchClosed(closed.reason, closed.code)
            if w.queue:
                ds, intents = w.take()
                self._settle()
                if intents:
                    self._apply(intents)
                return ds
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def close(self) -> None:
        self.shut("watch closed", CloseCode.CLOSED)


async def open_reader(
    hub: Hub, sid: str, offset: int | None, gen: str | None = None, *, notices: bool = False
) -> Reader:
    """A :class:`Reader` of ``sid`` opened on ``hub``: after ``offset`` (None: live only);
    ``notices``: the presence frames too."""
    r = Reader(hub, sid, offset, gen, notices=notices)
    await hub.open(r)
    return r
