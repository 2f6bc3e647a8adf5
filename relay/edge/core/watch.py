"""One local watcher of a session, as a pure state machine: a bounded queue, the resume
merge and conflation, fed by method calls, answering with intents. No asyncio, no
sockets, no clock: the caller (:class:`relay.edge.conn.base.Conn`) does every read and
write.

Two phases:

- **replaying**: its :class:`relay.edge.core.resume.Resume` merges the client's replay
  (backlog pages) with the live frames that arrive meanwhile, in order, once each;
- **live** (:attr:`Watch.live`, once the replay has caught up): the frames come from
  the session's channel, which already keeps them in order and without holes
  (:mod:`relay.edge.fanout.hub`), so the watch only drops the few it already has (its
  replay may have read past the channel's last frame) and follows a ``reset``. The
  resume is dropped: an idle live watch is one object, and :attr:`Watch.last` (the last
  offset handed on) is all it keeps of the merge. (A watch that holds a generation the
  session no longer has keeps its resume, which resets it on the new generation's first
  frame.) A connection with nothing queued may
  then write the channel's next frames itself (``frames[0].offset == last + 1``) and
  set :attr:`Watch.last`, without calling the watch at all.

Bounds:

- past ``queue_frames`` queued frames, each run of consecutive token frames of one turn
  (or delta frames of one part) is merged into one frame (:func:`conflate`, text only
  appends);
- past ``hard_limit_frames`` frames or ``max_pending_bytes`` bytes after merging, the
  watch closes with code ``slow_consumer``;
- the backlog is read page by page: the next page is asked for only while the queue is
  below its low-water mark (half of ``queue_frames`` and a quarter of the bytes), so a
  replay of any length reaches the client at the socket's own speed and never trips the
  slow-consumer cutoff (a page is at most ``page_frames`` frames).

A compacted join (``compact``: a :class:`relay.edge.core.compact.Compactor`): until the
replay has caught up, what it emits passes through the compactor (each finished turn's
token frames merged into one); then the compactor is dropped, and the live frames (a
repair's too) pass as they are.

Intents (what the driver must do): :class:`relay.edge.core.resume.Fetch` (read the
backlog after ``after``; at most one outstanding) and :class:`Closed` (stop; the code
says why).

Order of calls::

    w = Watch(sid, after, limits, counters, gen)  # gen: the client's generation, or ""
                                               # (compact=Compactor(): a compacted join)
    intents = w.subscribed()                   # once the channel is subscribed
    intents = w.offer(deliveries)              # every live frame, in channel order
    intents = w.backlog(entries, first, last, gen)  # the answer to a Fetch
    w.notice(delivery)                         # a frame outside the order (presence)
    frames, intents = w.take()                 # the socket has room: everything queued
    intents = w.close(code, reason)
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery, Fetch, Resume, ResumeState
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, decode, encode, first_offset, merge_key, merge_tokens

__all__ = ["Closed", "Intent", "Limits", "Watch", "conflate"]


class Closed(NamedTuple):
    """The watch is closed: stop writing and tell the client ``code`` / ``reason``."""

    code: CloseCode
    reason: str


Intent = Fetch | Closed


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-watch bounds. ``page_frames`` / ``page_bytes``: one backlog read at most."""

    queue_frames: int = 1024
    hard_limit_frames: int = 4096
    max_pending_bytes: int = 1 << 20
    page_frames: int = 512
    page_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if not 0 < self.queue_frames <= self.hard_limit_frames:
            raise ValueError("need 0 < queue_frames <= hard_limit_frames")
        if self.page_frames < 1 or self.page_bytes < 1 or self.max_pending_bytes < 1:
            raise ValueError("page sizes and max_pending_bytes must be >= 1")

    @property
    def low_water_frames(self) -> int:
        return max(self.queue_frames // 2, 1)

    @property
    def low_water_bytes(self) -> int:
        return max(self.max_pending_bytes // 4, 1)

    @property
    def replay_page_bytes(self) -> int:
        """A page's byte budget (one frame more at most, so every page makes progress)."""
        return max(min(self.page_bytes, self.low_water_bytes), 1)

    @property
    def replay_page_frames(self) -> int:
        """A page never pushes the queue past ``queue_frames`` (no merge of a replay)."""
        return max(min(self.page_frames, self.queue_frames - self.low_water_frames), 1)


def conflate(pending: Iterable[Delivery]) -> tuple[list[Delivery], int]:
    """Merge each run of consecutive token frames of one turn (or of one part's delta
    frames) into one frame.

    Returns the new list and how many runs were merged. Same concatenated text, same
    order; a merged frame carries the offset of the last frame it replaces, and
    ``meta = {"merged": n, "from": first offset}`` (cumulative across merges).
    """
    out: list[Delivery] = []
    run: list[tuple[Frame, Delivery]] = []
    merged = 0

    def flush() -> None:
        nonlocal merged
        if len(run) == 1:
            out.append(run[0][1])
        elif run:
            m = merge_tokens([f for f, _ in run])
            last = run[-1][1]
            out.append(Delivery(m.offset, last.kind, encode(m), last.ts, last.received_mono_ms))
            merged += 1
        run.clear()

    for d in pending:
        f = decode(d.data) if d.kind == "token" or d.kind == "part" else None
        key = merge_key(f) if f is not None else None
        if f is None or key is None:
            flush()
            out.append(d)
            continue
        if run and (f.turn != run[-1][0].turn or first_offset(f) != run[-1][0].offset + 1
                    or merge_key(run[-1][0]) != key):  # fmt: skip
            flush()
        run.append((f, d))
    flush()
    return out, merged


_NONE: tuple[Intent, ...] = ()


class Watch:
    """One watcher's queue and merge state. See the module docstring for the call order.

    ``counters`` (a plain dict the owner reads) gets ``conflations``, ``gaps``,
    ``duplicates``, ``frames_out``, ``slow_disconnects`` and ``compacted`` (replay frames
    a compacted join saved) added to it.

    Read by the connection's fast path (plain attributes, no call): :attr:`live`,
    :attr:`last` and :attr:`queue`."""

    __slots__ = (
        "_compact",
        "_conflate_at",
        "_deferred",
        "closed",
        "counters",
        "last",
        "limits",
        "live",
        "queue",
        "queued_bytes",
        "resume",
        "session",
    )

    def __init__(
        self,
        session: str,
        after: int | None,
        limits: Limits,
        counters: MutableMapping[str, int] | None = None,
        gen: str = "",
        compact: Compactor | None = None,
    ) -> None:
        self.session = session
        self.limits = limits
        self.resume: Resume | None = Resume(
            session,
            after,
            max_buffer=limits.hard_limit_frames,
            max_buffer_bytes=limits.max_pending_bytes,
            gen=gen,
        )
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        self.live = False  # caught up: frames pass without the resume merge
        self.last = 0  # the last offset handed on, once live
        self.queue: list[Delivery] = []  # frames the socket has not taken yet
        self.queued_bytes = 0
        self.closed: Closed | None = None
        self._deferred: Fetch | None = None  # the next replay page, held until the queue drains
        self._conflate_at = limits.queue_frames
        self._compact = compact  # a compacted join's, until its replay caught up

    @property
    def pending(self) -> int:
        return len(self.queue)

    # -- events ------------------------------------------------------------------------

    def subscribed(self) -> Sequence[Intent]:
        if self.closed is not None or self.resume is None:
            return _NONE
        return self._fetch_or_defer(self.resume.subscribed().fetch, replay=False)

    def offer(self, ds: Iterable[Delivery]) -> Sequence[Intent]:
        """Live frames, in the channel's order."""
        if self.closed is not None:
            return _NONE
        resume = self.resume
        if resume is None:
            pushed = self._push(self._follow(ds))
            return list(pushed) if pushed else _NONE
        intents: list[Intent] | None = None
        out: list[Delivery] = []
        for d in ds:
            if resume.next_live(d):
                out.append(d)
                continue
            step = resume.live(d)
            if step.emit:
                out.extend(step.emit)
            if step.fetch is not None:
                intents = [*(intents or ()), step.fetch]
        if out:
            pushed = self._push(out)
            if pushed:
                intents = [*(intents or ()), *pushed]
        return intents or _NONE

    def backlog(
        self,
        entries: Sequence[Delivery],
        first_available: int,
        last_offset: int,
        gen: str = "",
        decoded: Sequence[Frame] = (),
    ) -> Sequence[Intent]:
        """The answer to the outstanding fetch (``gen``: the session's generation then;
        ``decoded``: the entries' frames, if the driver has them, for a compacted join):
        frames go to the queue, the next page is asked for now or held until
        :meth:`take` brings the queue below low water; once the replay has caught up
        the watch is :attr:`live`."""
        resume = self.resume
        if resume is None:
            return _NONE
        step = resume.backlog(entries, first_available, last_offset, gen)
        if self.closed is not None:
            return _NONE
        emit = step.emit
        compact = self._compact
        if compact is not None:
            emit = compact.feed(emit, zip(entries, decoded, strict=False))
            if step.fetch is None:  # caught up: the open run as it is, and no more merging
                emit += compact.flush()
                self._compact = None
                if compact.merged:
                    c = self.counters
                    c["compacted"] = c.get("compacted", 0) + compact.merged
        intents = list(self._push(emit)) if emit else []
        if self.closed is None:
            if step.fetch is None and resume.state is ResumeState.LIVE:
                # the channel's order is the watch's from now on, unless the watch holds
                # a generation the session does not have (its keys expired, no new turn
                # yet): its resume then still has to reset it on the new one's first frame
                if not resume.gen or resume.gen == gen:
                    self._go_live(resume)
            else:
                intents.extend(self._fetch_or_defer(step.fetch, replay=True))
        return intents

    def notice(self, d: Delivery) -> None:
        """A frame outside the session's order (presence), queued after what is queued,
        past the merge and the replay: it is not an offset. One that is still queued
        last is replaced by the newer one (a count that waits is never worth two)."""
        if self.closed is not None:
            return
        q = self.queue
        if q and q[-1].offset == 0 and q[-1].kind == d.kind:
            self.queued_bytes -= len(q[-1].data)
            q[-1] = d
        else:
            q.append(d)
        self.queued_bytes += len(d.data)

    def take(self) -> tuple[list[Delivery], Sequence[Intent]]:
        """Everything queued, in order (the socket has room), and the held page fetch."""
        if self.closed is not None or not self.queue:
            return [], self._release()
        out, self.queue = self.queue, []
        self.queued_bytes = 0
        self._conflate_at = self.limits.queue_frames
        self.counters["frames_out"] = self.counters.get("frames_out", 0) + len(out)
        return out, self._release()

    def close(self, code: CloseCode, reason: str) -> Sequence[Intent]:
        if self.closed is not None:
            return _NONE
        self.closed = Closed(code, reason)
        self.live = False  # nothing passes any more, not even the connection's fast path
        self.queue = []
        self.queued_bytes = 0
        self._deferred = None
        if self.resume is not None:
            self.resume.close()
        return (self.closed,)

    # -- helpers -----------------------------------------------------------------------

    def _go_live(self, resume: Resume) -> None:
        """The replay caught up: from now on the channel's order is the watch's."""
        assert resume.last is not None
        self.live, self.last, self.resume = True, resume.last, None
        if resume.duplicates:
            c = self.counters
            c["duplicates"] = c.get("duplicates", 0) + resume.duplicates

    def _follow(self, ds: Iterable[Delivery]) -> list[Delivery]:
        """A live watch's share of the channel's frames: those after :attr:`last` (its
        replay may have read a few the channel had not sent yet), and a ``reset``,
        after which offsets start again."""
        out: list[Delivery] = []
        last = self.last
        for d in ds:
            if d.kind == "reset":
                last = 0
            elif d.offset <= last:
                self.counters["duplicates"] = self.counters.get("duplicates", 0) + 1
                continue
            else:
                last = d.offset
            out.append(d)
        self.last = last
        return out

    def _below_low_water(self) -> bool:
        lim = self.limits
        return len(self.queue) < lim.low_water_frames and self.queued_bytes < (lim.low_water_bytes)

    def _fetch_or_defer(self, fetch: Fetch | None, *, replay: bool) -> Sequence[Intent]:
        if fetch is None:
            return _NONE
        if replay and not self._below_low_water():
            self._deferred = fetch
            return _NONE
        return (fetch,)

    def _release(self) -> Sequence[Intent]:
        if self._deferred is not None and self._below_low_water():
            fetch, self._deferred = self._deferred, None
            return (fetch,)
        return _NONE

    def _push(self, ds: list[Delivery]) -> Sequence[Intent]:
        """Queue ``ds`` (a list the watch may keep: :meth:`offer` made it)."""
        if not ds:
            return _NONE
        c = self.counters
        size = 0
        for d in ds:
            size += len(d.data)
            if d.kind == "gap":
                c["gaps"] = c.get("gaps", 0) + 1
        if self.queue:
            self.queue.extend(ds)
        else:
            self.queue = ds
        self.queued_bytes += size
        lim = self.limits
        if len(self.queue) > self._conflate_at or self.queued_bytes > lim.max_pending_bytes:
            merged_list, merged = conflate(self.queue)
            if merged:
                c["conflations"] = c.get("conflations", 0) + merged
                self.queue = merged_list
                self.queued_bytes = sum(len(d.data) for d in merged_list)
            self._conflate_at = len(self.queue) + max(lim.queue_frames // 4, 1)
            if len(self.queue) > lim.hard_limit_frames:
                return self._slow(f"more than {lim.hard_limit_frames} frames pending after merging")
            if self.queued_bytes > lim.max_pending_bytes:
                return self._slow(f"more than {lim.max_pending_bytes} bytes pending after merging")
        return _NONE

    def _slow(self, reason: str) -> Sequence[Intent]:
        self.counters["slow_disconnects"] = self.counters.get("slow_disconnects", 0) + 1
        return self.close(CloseCode.SLOW_CONSUMER, reason)
