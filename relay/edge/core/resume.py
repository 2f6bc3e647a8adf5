"""The resume merge for one reader of a session: backlog + live, in order, once each.

Pure (stdlib, msgspec, relay.protocol.frame): no sockets, no clock, no asyncio. The hub drives one
:class:`Resume` per watcher and one per subscribed channel (channel-level ordering).

Lifecycle (transitions live in :data:`TRANSITIONS`, nowhere else)::

    SUBSCRIBING --subscribed--> REPLAYING --caught_up--> LIVE
                                   ^  |                    |
                                   |  +------hole/repair---+ (back to REPLAYING)
    any state --close--> CLOSED

Order of calls:

1. ``r = Resume(session, after, gen=...)`` right before the channel is subscribed.
   ``after`` is the last offset the reader already has (``0`` = everything in the
   backlog, ``None`` = live only, from the current end); ``gen`` the generation that
   offset belongs to, when the reader knows it ("" = unknown). Live frames delivered
   before :meth:`subscribed` are buffered.
2. ``step = r.subscribed()`` once the subscription is confirmed: ``step.fetch`` asks the
   driver to read the backlog after ``step.fetch.after`` (``None``: read no frames, only
   the stream's bounds).
3. The driver answers every fetch with :meth:`backlog` and feeds every live frame to
   :meth:`live`; :meth:`repair` after a topology change. Each call returns a
   :class:`Step`: frames to emit now (in order) and at most one fetch to perform.
   There is never more than one fetch outstanding.
4. :meth:`close`.

Rules: a frame at or below the last emitted offset is a duplicate and is dropped; a
frame above ``last + 1`` is a hole: it is buffered and the machine asks for the backlog
after ``last`` instead of emitting; frames that the backlog no longer holds become one
explicit ``gap`` delivery (see :func:`relay.protocol.frame.gap_frame`), never a silent skip.

Session generations: every frame carries its session's generation id (``gen``). A
frame of another generation than the last one emitted (the session's keys expired and
restarted, offsets begin again at 1) is not a duplicate: the reader emits one
``reset`` delivery (:func:`relay.protocol.frame.reset_frame`, offset 0), forgets its offsets
and buffer, and continues with the new generation from offset 1 (reading the backlog
when the frame is not offset 1). A ``reset`` delivery from upstream (the channel's
reader, for a watcher's) does the same. Every backlog answer also says the session's
current generation (its meta hash's ``gen``): when it is not the reader's, the reader
resets and reads the current one from offset 1, whatever offset it asked for (a client
that resumes with the generation it holds is never served another generation's frames
as if they continued its own). A reader whose ``gen`` was given but the session has
none now (its keys expired, no new turn yet) goes live at the end and resets on the
first frame of the new generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, NamedTuple

import msgspec

from relay.protocol.frame import encode, gap_frame, reset_frame

__all__ = [
    "TRANSITIONS",
    "Delivery",
    "Fetch",
    "InvalidTransition",
    "Resume",
    "ResumeState",
    "Step",
    "gap_delivery",
    "reset_delivery",
]


class Delivery(msgspec.Struct, gc=False):
    """One frame for a socket: its offset, its kind and the encoded bytes as published.

    ``ts`` is the producer's timestamp (wall-clock ms) and ``received_mono_ms`` when the
    relay read the frame from its live subscription, on this process's monotonic clock
    (:func:`relay.protocol.frame.monotonic_ms`; 0 for frames replayed from the backlog):
    the relay's own queueing (edge -> socket) is timed on the monotonic clock.

    ``sse`` and ``ws`` are the frame as an SSE event and as a WebSocket text frame,
    filled in by the first socket that writes it (:mod:`relay.edge.conn.streams`): every
    watcher of a session gets the same delivery objects from one read, so a frame is
    encoded once per relay, however many sockets it goes to. (A msgspec struct: made
    and read in C, and, holding no containers, never tracked by the garbage collector.)
    """

    offset: int
    kind: str
    data: bytes
    ts: int = 0
    received_mono_ms: int = 0
    gen: str = ""  # the session generation (frame meta ``gen``), "" when unknown
    sse: bytes | None = None
    ws: bytes | None = None


class ResumeState(Enum):
    SUBSCRIBING = "subscribing"
    REPLAYING = "replaying"
    LIVE = "live"
    CLOSED = "closed"


S = ResumeState
_LIVE: Final = ResumeState.LIVE  # a module global: an enum member lookup costs ~70 ns
TRANSITIONS: Final[dict[tuple[ResumeState, str], ResumeState]] = {
    (S.SUBSCRIBING, "subscribed"): S.REPLAYING,
    (S.REPLAYING, "caught_up"): S.LIVE,
    (S.REPLAYING, "hole"): S.REPLAYING,
    (S.REPLAYING, "repair"): S.REPLAYING,
    (S.LIVE, "hole"): S.REPLAYING,
    (S.LIVE, "repair"): S.REPLAYING,
    (S.SUBSCRIBING, "close"): S.CLOSED,
    (S.REPLAYING, "close"): S.CLOSED,
    (S.LIVE, "close"): S.CLOSED,
    (S.CLOSED, "close"): S.CLOSED,
}


class InvalidTransition(RuntimeError):
    """An event that the current state does not accept (a driver bug)."""


class Fetch(NamedTuple):
    """Read the backlog after ``after`` (``None``: no frames, only first/last offsets)."""

    after: int | None


@dataclass(slots=True)
class Step:
    emit: list[Delivery] = field(default_factory=list)
    fetch: Fetch | None = None


def gap_delivery(session: str, first_missing: int, first_available: int, gen: str = "") -> Delivery:
    """The explicit delivery for frames ``first_missing .. first_available - 1`` lost for
    good from the backlog of generation ``gen``."""
    gap = gap_frame(session, first_missing, first_available, gen)
    return Delivery(gap.offset, "gap", encode(gap), gen=gen)


def reset_delivery(session: str, gen: str, previous: str) -> Delivery:
    """The explicit delivery for a session that restarted under generation ``gen``."""
    return Delivery(0, "reset", encode(reset_frame(session, gen, previous)), gen=gen)


class Resume:
    """Merge state of one reader. See the module docstring for the call order."""

    __slots__ = (
        "_buffer",
        "_buffer_bytes",
        "_fetching",
        "_first_read",
        "_refetch",
        "_stale",
        "_stalls",
        "duplicates",
        "gaps",
        "gen",
        "holes",
        "last",
        "max_buffer",
        "max_buffer_bytes",
        "overflow",
        "resets",
        "session",
        "state",
    )

    def __init__(
        self,
        session: str,
        after: int | None,
        *,
        max_buffer: int = 4096,
        max_buffer_bytes: int = 0,
        gen: str = "",
    ) -> None:
        if after is not None and after < 0:
            raise ValueError("after must be >= 0 or None")
        self.session = session
        self.state = ResumeState.SUBSCRIBING
        self.last: int | None = after  # last offset emitted (or known to the reader)
        self.max_buffer = max_buffer
        self.max_buffer_bytes = max_buffer_bytes  # 0: bounded by frames only
        self._buffer_bytes = 0
        self._buffer: dict[int, Delivery] | None = None  # made by the first frame held
        self._fetching = False
        self._refetch = False  # a repair or a dropped buffered frame needs one more read
        self._stale = False  # the read in flight began before a reset: its answer is old
        self._first_read = True
        self._stalls = 0
        self.duplicates = 0
        self.gaps = 0
        self.holes = 0
        self.overflow = 0
        self.resets = 0
        # generation of the frames emitted last ("" until one says); seeded with the
        # reader's own when it resumes one it knows
        self.gen = gen

    # -- state ---------------------------------------------------------------------------

    def _fire(self, event: str) -> None:
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            raise InvalidTransition(f"{event!r} in state {self.state.name}")
        self.state = new

    def _fetch(self) -> Fetch:
        self._fetching = True
        self._refetch = False
        return Fetch(self.last if not (self._first_read and self.last is None) else None)

    @property
    def fetching(self) -> bool:
        return self._fetching

    @property
    def started(self) -> bool:
        """True once the first backlog answer was taken (``last`` is then a real offset)."""
        return not self._first_read

    # -- events --------------------------------------------------------------------------

    def subscribed(self) -> Step:
        self._fire("subscribed")
        return Step(fetch=self._fetch())

    def next_live(self, d: Delivery) -> bool:
        """The common case of :meth:`live`, without its allocations: True if ``d`` is
        the next frame of a live stream with no hole and no change of generation (it is
        then emitted: the caller takes ``d`` as :meth:`live`'s one frame); False, with
        nothing changed, for anything else (the caller calls :meth:`live`)."""
        last = self.last
        if (
            self.state is not _LIVE
            or last is None
            or d.offset != last + 1
            or self._buffer is not None
            or d.kind == "reset"
        ):
            return False
        gen = d.gen
        if gen:
            if self.gen and gen != self.gen:
                return False
            self.gen = gen
        self.last = d.offset
        return True

    def live(self, d: Delivery) -> Step:
        if self.state is ResumeState.CLOSED:
            return Step()
        if d.kind == "reset" or self._new_gen(d):
            return self._reset(d)
        if self.last is not None and d.offset <= self.last:
            self.duplicates += 1
            return Step()
        if self.state is not ResumeState.LIVE:
            self._stash(d)
            return Step()
        assert self.last is not None
        if d.offset == self.last + 1:
            self.last = d.offset
            out = [d]
            self._drain(out)
            self._saw_gen(out)
            return Step(out)
        self.holes += 1
        self._stash(d)
        self._fire("hole")
        return Step(fetch=self._fetch())

    def repair(self) -> Step:
        """The live feed may have lost frames (resubscribe, reconnect): re-read the backlog."""
        if self.state in (ResumeState.CLOSED, ResumeState.SUBSCRIBING):
            return Step()
        self._fire("repair")
        if self._fetching:
            self._refetch = True
            return Step()
        return Step(fetch=self._fetch())

    def backlog(
        self,
        entries: Sequence[Delivery],
        first_available: int,
        last_offset: int,
        gen: str = "",
    ) -> Step:
        """The answer to the outstanding fetch.

        ``entries`` are backlog frames after the fetch's offset (in order, possibly only a
        page); ``first_available`` is the oldest offset the backlog still holds (``last
        offset + 1`` when it is empty); ``last_offset`` the newest offset written;
        ``gen`` the session's generation at the time of the read ("" when it has none
        or the driver does not say).
        """
        if self.state is ResumeState.CLOSED:
            self._fetching = False
            return Step()
        if self.state is not ResumeState.REPLAYING or not self._fetching:
            raise InvalidTransition(f"backlog without a fetch in state {self.state.name}")
        self._fetching = False
        out: list[Delivery] = []
        if self._stale:  # read before a reset we already emitted: read again
            self._stale = False
            self._first_read = False
            return Step(out, self._fetch())
        if gen and self.gen and gen != self.gen:
            # the session is now another generation than the one we (or the client)
            # hold: whatever the offset, read the current one from its start
            self._first_read = False
            out.append(self._restart(gen))
            return Step(out, self._fetch())
        if gen and not self.gen:
            self.gen = gen
        if self.last is None or (self._first_read and self.last > last_offset):
            # live only (start at the current end), or a reader that claims offsets the
            # session never wrote (its keys expired and restarted): start at the end.
            self.last = last_offset
            if not self.gen and last_offset > 0 and not entries and not self._buffer:
                # read the last frame once, only to learn the session's generation: a
                # reader that does not know it could not tell a restart from duplicates
                self._first_read = False
                self._fetching = True
                return Step(out, Fetch(last_offset - 1))
        self._first_read = False
        if entries and self._new_gen(entries[0]):
            # the session restarted since our last read: read the new one from its start
            out.append(self._restart(entries[0].gen))
            return Step(out, self._fetch())
        if entries and not self.gen:
            self.gen = entries[0].gen
        before = self.last
        if self.last + 1 < first_available and self.last < last_offset:
            self._gap(out, first_available)
        for e in entries:
            if e.offset <= self.last:
                continue
            if e.offset != self.last + 1:
                self._gap(out, e.offset)  # the backlog itself has a hole: report it
            out.append(e)
            self.last = e.offset
        self._saw_gen(out)
        if self.last < last_offset:
            if entries:
                return Step(out, self._fetch())  # next page
            self._gap(out, last_offset + 1)  # the bounds promised frames that are gone
        self._drain(out)
        if self._buffer:
            nxt = min(self._buffer)
            self._stalls = 0 if self.last != before else self._stalls + 1
            if self._stalls >= 2:  # two reads in a row could not fill it: lost for good
                self._stalls = 0
                self._gap(out, nxt)
                self._drain(out)
            if self._buffer:
                return Step(out, self._fetch())
        self._stalls = 0
        if self._refetch:
            return Step(out, self._fetch())
        self._fire("caught_up")
        return Step(out)

    def close(self) -> None:
        self._fire("close")
        self._buffer = None
        self._buffer_bytes = 0

    # -- helpers -------------------------------------------------------------------------

    def _new_gen(self, d: Delivery) -> bool:
        return bool(d.gen) and bool(self.gen) and d.gen != self.gen

    def _saw_gen(self, out: Sequence[Delivery]) -> None:
        for d in reversed(out):
            if d.gen:
                self.gen = d.gen
                return

    def _restart(self, gen: str) -> Delivery:
        """Forget the old generation: offsets, buffer; the reset delivery to emit."""
        reset = reset_delivery(self.session, gen, self.gen)
        self.gen = gen
        self.last = 0
        self._buffer = None
        self.resets += 1
        return reset

    def _reset(self, d: Delivery) -> Step:
        """A new generation (or an upstream reset): emit a reset, then take ``d`` as the
        first frame of the new stream (a reset delivery itself carries no frame)."""
        out = [self._restart(d.gen)]
        if d.kind == "reset":
            return Step(out)
        if self.state is ResumeState.LIVE and d.offset == 1:
            self.last = 1
            out.append(d)
            return Step(out)
        self._stash(d)
        if self.state is ResumeState.LIVE:
            self._fire("hole")
            return Step(out, self._fetch())
        if self._fetching:
            self._stale = True  # the answer in flight may be of the old generation
        return Step(out)

    def _stash(self, d: Delivery) -> None:
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = {}
        if d.offset in buffer:
            self.duplicates += 1
            return
        if len(buffer) >= self.max_buffer or (
            self.max_buffer_bytes and self._buffer_bytes + len(d.data) > self.max_buffer_bytes
        ):
            # safe to forget: every published frame is in the backlog; read it again later
            self.overflow += 1
            self._refetch = True
            return
        buffer[d.offset] = d
        self._buffer_bytes += len(d.data)

    def _drain(self, out: list[Delivery]) -> None:
        buffer = self._buffer
        if not buffer:
            self._buffer = None  # (an overflow can leave it made and empty)
            return
        assert self.last is not None
        for off in sorted(buffer):
            if off <= self.last:
                self._buffer_bytes -= len(buffer.pop(off).data)
                self.duplicates += 1
            elif off == self.last + 1:
                d = buffer.pop(off)
                self._buffer_bytes -= len(d.data)
                out.append(d)
                self.last = off
            else:
                break
        if not buffer:
            self._buffer = None

    def _gap(self, out: list[Delivery], first_available: int) -> None:
        assert self.last is not None
        out.append(gap_delivery(self.session, self.last + 1, first_available, self.gen))
        self.last = first_available - 1
        self.gaps += 1
