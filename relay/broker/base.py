"""What the edge needs of the store behind it: the :class:`Broker` interface.

The relay's fan-out (:mod:`relay.edge.fanout.hub`), its reaper and its connections use
the backend only through this interface, so the rules of fan-out, resume and cutoff run
unchanged on :class:`relay.broker.memory.MemoryBroker` (tests and
``bench.relay.micro``, no server) and on :class:`relay.broker.redis.broker.RedisBroker`
(production: sharded Pub/Sub on a Redis 7 Cluster, one connection per shard).

A broker holds, per session: an append-only backlog of encoded frames with offsets
1, 2, 3, ... (trimmed from the front), the session's generation id, whether a turn is
open, and a live channel on which every appended frame is also sent. What it does for
the edge:

- **live frames**: :meth:`Broker.subscribe` a session (once per relay: the hub counts
  its watchers) and every frame appended to it afterwards reaches the handler given to
  :meth:`Broker.bind`, in append order, as a list of messages per read
  (``message[1]`` is :meth:`Broker.channel` of the session, ``message[2]`` the frame's
  bytes). A frame may be lost on its way (a failover, a dropped connection); the hub
  repairs from the backlog, and :meth:`Broker.bind`'s ``on_resubscribed`` names the
  sessions whose live feed may have lost frames;
- **backlog reads**: :meth:`Broker.read_page`, one consistent answer: frames after an
  offset, the first offset still held, the last written, the generation;
- **seal** and **reap**: the two writes a relay makes (a ``gap`` frame over offsets a
  failover lost; an ``error`` frame ending a turn whose producer died);
- **presence**: which sessions this relay has viewers of (the producers' "nobody
  watches" rule reads it), and how many screens it serves each to
  (:meth:`Broker.screens`: the session's total over every relay comes back to every
  relay's subscribers as a ``presence`` frame, outside the session's order);
- :meth:`Broker.active_turn` (the AI SDK's resume), :meth:`Broker.ping` (readiness),
  :meth:`Broker.stats` (metrics).

Failures are :class:`relay.broker.errors.RelayError` subclasses:
``RedisUnavailable`` while the store cannot be reached (retry), ``SubscribeError`` when
a subscription is not confirmed in time, ``SessionDeleted`` from a read of a session
that was deleted (its tombstone exists; the read that answers it is the one a watch
makes anyway, so a relay learns it without asking more).

Order of use::

    broker.bind(hub_on_message, hub_on_resubscribed)
    await broker.start(supervisor)          # its background loops run on the supervisor
    await broker.subscribe(sid)             # returns once live frames flow
    page = await broker.read_page(sid, after, count, max_bytes)
    broker.unsubscribe(sid); await broker.close()
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple, Protocol

from relay.broker.errors import RelayError
from relay.service.supervise import Supervisor

__all__ = [
    "SUPERSEDED",
    "SUPERSEDED_TEXT",
    "BacklogPage",
    "Broker",
    "MessageHandler",
    "ReapResult",
    "ReapStatus",
    "ResubscribedHandler",
]

# The error frame that ends a turn still open when the session's next turn opens (its
# producer died or lost its lock, and the next turn came before a relay reaped it):
# ``meta.code`` and text, as lua/open.lua writes them.
SUPERSEDED: Final = "superseded"
SUPERSEDED_TEXT: Final = "interrupted: the next turn started"

# the live messages of one read, in order: message[1] the channel, message[2] the frame
MessageHandler = Callable[[list[list[bytes]]], None]
# sessions whose live feed may have lost frames (resubscribed after a move or a failover)
ResubscribedHandler = Callable[[list[str]], None]


class BacklogPage(NamedTuple):
    """A backlog read: frames, first available offset, last written, the session's
    generation ("" when it has none)."""

    frames: list[bytes]
    first: int
    last: int
    gen: str


class ReapStatus(enum.StrEnum):
    """What a reap found (compares equal to the reap script's reply)."""

    REAPED = "reaped"  # an error frame was written at ``offset`` for ``turn``
    LOCKED = "locked"  # a producer still holds the turn lock
    IDLE = "idle"  # no turn is open


class ReapResult(NamedTuple):
    """What a reap did (see :class:`ReapStatus`)."""

    status: ReapStatus
    offset: int
    turn: int


class Broker(Protocol):
    """The edge's backend. See the module docstring."""

    relay_id: str

    def channel(self, sid: str) -> bytes:
        """What the live messages of ``sid`` carry as ``message[1]``."""

    def bind(self, on_message: MessageHandler, on_resubscribed: ResubscribedHandler) -> None:
        """Where live messages and resubscriptions go (before :meth:`start`)."""

    async def start(self, supervisor: Supervisor) -> None:
        """Connect; run the background loops (subscriptions, presence) on ``supervisor``."""

    async def close(self) -> None:
        """Remove this relay's presence, close the connections (stop the supervisor first)."""

    async def subscribe(self, sid: str) -> None:
        """Live frames of ``sid`` from now on; returns once the store confirmed."""

    def unsubscribe(self, sid: str) -> None:
        """No more live frames of ``sid``."""

    async def read_page(
        self, sid: str, after: int | None, count: int, max_bytes: int
    ) -> BacklogPage:
        """Up to ``count`` frames after offset ``after`` (at most ``max_bytes`` bytes past
        the first; 0: no byte bound) and the bounds; ``after`` None: the bounds only.
        Raises ``SessionDeleted`` when the session was deleted."""

    async def seal(self, sid: str, seen: int, gen: str) -> int:
        """A ``gap`` frame at ``seen`` over the offsets the backlog lost below it (a
        failover); how many were sealed (0: nothing was missing, or another ``gen``)."""

    async def reap(self, sid: str) -> ReapResult:
        """End the session's open turn with an ``error`` frame if its producer is gone."""

    def present(self, sid: str) -> None:
        """This relay has viewers of ``sid`` (its first local watcher opened)."""

    def absent(self, sid: str) -> None:
        """This relay has no viewer of ``sid`` any more."""

    async def screens(self, counts: Sequence[tuple[str, int]]) -> list[int | RelayError]:
        """For each ``(sid, count)``: this relay serves ``sid`` to ``count`` screens (0:
        none): written, and the session's total over the relays whose presence is live
        sent on its live channel as a ``presence`` frame (offset 0, in no backlog). Per
        session its total, or the error that kept it from being written
        (``SessionDeleted``: the session was deleted, nothing written); raises
        ``RelayError`` when none could be."""

    async def active_turn(self, sid: str) -> tuple[int, int] | None:
        """The turn that is generating and the offset right before its first frame;
        raises ``SessionDeleted`` when the session was deleted."""

    async def ping(self) -> None:
        """Raise unless the store answers (readiness)."""

    def stats(self) -> Mapping[str, Any]:
        """Counters for the metrics (subscriptions per node, presence writes, ...)."""
