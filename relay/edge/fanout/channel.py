"""One subscribed session channel as the hub holds it, and what the hub drives of a
connection (:class:`Watcher`).

A :class:`Channel` is the hub's state of one session it subscribed for its local
connections: the connections (one, held without a set, or many), the channel-level
:class:`relay.edge.core.resume.Resume` (order, holes, repairs), its subscription's
readiness, the frames of the read being handed out, the last presence frame (what a
screen that opens gets at once: :mod:`relay.edge.fanout.notices`), and the fields the reaper reads
(:class:`relay.edge.fanout.reaper.Reapable`). The hub's live path reads and writes its
fields directly (:meth:`relay.edge.fanout.hub.Hub._on_message`); nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from relay.edge.core.resume import Delivery, Resume
from relay.protocol.codes import CloseCode
from relay.service.supervise import retrieve

__all__ = ["Channel", "Watcher"]


class Watcher(Protocol):
    """What the hub drives of a connection (:class:`relay.edge.conn.base.Conn`)."""

    sid: str
    offset: int | None
    stop: tuple[CloseCode, str] | None  # why the relay ended it, once it said

    @property
    def closed(self) -> bool: ...

    def subscribed(self) -> None:
        """The channel is subscribed: start the replay."""

    async def first_read(self) -> None:
        """Return once the first backlog answer is in."""

    def feed(self, ds: list[Delivery]) -> None:
        """The channel's live frames of one read, in order."""

    def shut(self, reason: str, code: CloseCode) -> None:
        """End the watch."""

    def notice(self, d: Delivery) -> None:
        """A frame outside the session's order (the presence count): written when the
        socket has room, never taken as an offset (not a duplicate, not a gap, not a
        resume point)."""

    def farewell(self, d: Delivery, reason: str, code: CloseCode) -> None:
        """End the watch with ``d`` as its last frame, then the goodbye for ``code``
        (the session was deleted: its notice, then the close)."""


class Channel:
    """The hub's state of one subscribed session channel. See the module docstring."""

    __slots__ = (
        "batch",
        "dead",
        "fetch_task",
        "key",
        "last_frame",
        "many",
        "one",
        "presence",
        "ready",
        "reap_next",
        "reaping",
        "resume",
        "sid",
        "turn_open",
        "unsub_handle",
    )

    def __init__(self, sid: str, key: bytes) -> None:
        self.sid, self.key = sid, key
        # its connections: most sessions have one on a relay, held without a set
        self.one: Watcher | None = None
        self.many: set[Watcher] | None = None  # two or more
        self.resume = Resume(sid, None)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(retrieve)
        self.dead = False
        self.unsub_handle: asyncio.TimerHandle | None = None
        self.fetch_task: asyncio.Task[None] | None = None
        self.batch: list[Delivery] | None = None  # this read's frames, before the hand-off
        self.presence: Delivery | None = None  # the last presence frame: a new screen's count
        # the reaper's view (relay.edge.fanout.reaper.Reapable)
        self.turn_open = True  # a turn may be open until a done/error frame says otherwise
        self.last_frame = time.monotonic()
        self.reap_next = 0.0
        self.reaping = False

    def add(self, w: Watcher) -> None:
        if self.many is not None:
            self.many.add(w)
        elif self.one is None:
            self.one = w
        elif self.one is not w:
            self.many, self.one = {self.one, w}, None

    def discard(self, w: Watcher) -> bool:
        """Remove ``w``; False if it was not there."""
        if self.one is w:
            self.one = None
            return True
        many = self.many
        if many is None or w not in many:
            return False
        many.discard(w)
        if len(many) == 1:
            self.one, self.many = many.pop(), None
        return True

    @property
    def watched(self) -> int:
        return len(self.many) if self.many is not None else int(self.one is not None)

    def watchers(self) -> list[Watcher]:
        if self.many is not None:
            return list(self.many)
        return [] if self.one is None else [self.one]
