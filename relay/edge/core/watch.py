"""One local watcher of a session, as a pure state machine: a bounded queue, the resume
merge and conflation, fed by method calls, answering with intents. No asyncio, no
sockets, no clock: the caller (:class:`relay.edge.fanout.tap.Tap`) does every read and write.

What it holds: its own :class:`relay.edge.core.resume.Resume` (the client's replay merged with the
live feed, in order, once each) and the frames not yet taken by the socket. Bounds:

- past ``queue_frames`` pending frames, each run of consecutive token frames of one turn
  is merged into one frame (:func:`conflate`, text only appends);
- past ``hard_limit_frames`` frames or ``max_pending_bytes`` bytes after merging, the
  watch closes with code ``slow_consumer``;
- the backlog is read page by page: the next page is asked for only while the queue is
  below its low-water mark (half of ``queue_frames`` and a quarter of the bytes), so a
  replay of any length reaches the client at the socket's own speed and never trips the
  slow-consumer cutoff (a page is at most ``page_frames`` frames).

Intents (what the driver must do): :class:`relay.edge.core.resume.Fetch` (read the backlog after
``after``; at most one outstanding) and :class:`Closed` (stop; the code says why).

Order of calls::

    w = Watch(sid, after, limits, counters, gen)  # gen: the client's generation, or ""
    intents = w.subscribed()                   # once the channel is subscribed
    intents = w.live(deliveries)               # every live frame, in channel order
    intents = w.backlog(entries, first, last, gen)  # the answer to a Fetch
    frames, intents = w.take()                 # the socket has room: everything pending
    intents = w.close(code, reason)
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from relay.edge.core.resume import Delivery, Fetch, Resume
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, decode, encode, first_offset, merge_tokens

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
    """Merge each run of consecutive token frames of one turn into one frame.

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
            out.append(Delivery(m.offset, "token", encode(m), last.ts, last.received_mono_ms))
            merged += 1
        run.clear()

    for d in pending:
        if d.kind != "token":
            flush()
            out.append(d)
            continue
        f = decode(d.data)
        if run and (f.turn != run[-1][0].turn or first_offset(f) != run[-1][0].offset + 1):
            flush()
        run.append((f, d))
    flush()
    return out, merged


_NONE: tuple[Intent, ...] = ()


class Watch:
    """One watcher's queue and merge state. See the module docstring for the call order.

    ``counters`` (a plain dict the owner reads) gets ``conflations``, ``gaps``,
    ``frames_out`` and ``slow_disconnects`` added to it."""

    __slots__ = (
        "_conflate_at",
        "_deferred",
        "_pending",
        "closed",
        "counters",
        "limits",
        "pending_bytes",
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
    ) -> None:
        self.session = session
        self.limits = limits
        self.resume = Resume(
            session,
            after,
            max_buffer=limits.hard_limit_frames,
            max_buffer_bytes=limits.max_pending_bytes,
            gen=gen,
        )
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        self._pending: list[Delivery] = []
        self.pending_bytes = 0
        self.closed: Closed | None = None
        self._deferred: Fetch | None = None  # the next replay page, held until the queue drains
        self._conflate_at = limits.queue_frames

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def page_frames(self) -> int:
        return self.limits.replay_page_frames

    # -- events ------------------------------------------------------------------------

    def subscribed(self) -> Sequence[Intent]:
        if self.closed is not None:
            return _NONE
        return self._fetch_or_defer(self.resume.subscribed().fetch, replay=False)

    def live(self, ds: Iterable[Delivery]) -> Sequence[Intent]:
        if self.closed is not None:
            return _NONE
        resume = self.resume
        intents: list[Intent] | None = None
        out: list[Delivery] = []
        for d in ds:
            if resume.next_live(d):  # the common case: the next frame, nothing to merge
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
        self, entries: Sequence[Delivery], first_available: int, last_offset: int, gen: str = ""
    ) -> Sequence[Intent]:
        """The answer to the outstanding fetch (``gen``: the session's generation then):
        frames go to the queue, the next page is asked for now or held until
        :meth:`take` brings the queue below low water."""
        if self.closed is not None:
            self.resume.backlog(entries, first_available, last_offset, gen)
            return _NONE
        step = self.resume.backlog(entries, first_available, last_offset, gen)
        intents = list(self._push(step.emit)) if step.emit else []
        if self.closed is None:
            intents.extend(self._fetch_or_defer(step.fetch, replay=True))
        return intents

    def take(self) -> tuple[list[Delivery], Sequence[Intent]]:
        """Everything pending, in order (the socket has room), and the held page fetch."""
        if self.closed is not None or not self._pending:
            return [], self._release()
        out, self._pending = self._pending, []
        self.pending_bytes = 0
        self._conflate_at = self.limits.queue_frames
        self.counters["frames_out"] = self.counters.get("frames_out", 0) + len(out)
        return out, self._release()

    def close(self, code: CloseCode, reason: str) -> Sequence[Intent]:
        if self.closed is not None:
            return _NONE
        self.closed = Closed(code, reason)
        self._pending.clear()
        self.pending_bytes = 0
        self._deferred = None
        self.resume.close()
        return (self.closed,)

    # -- helpers -----------------------------------------------------------------------

    def _below_low_water(self) -> bool:
        lim = self.limits
        return len(self._pending) < lim.low_water_frames and self.pending_bytes < (
            lim.low_water_bytes
        )

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
        """Queue ``ds`` (a list the watch may keep: :meth:`live` made it)."""
        c = self.counters
        size = 0
        for d in ds:
            size += len(d.data)
            if d.kind == "gap":
                c["gaps"] = c.get("gaps", 0) + 1
        if self._pending:
            self._pending.extend(ds)
        else:
            self._pending = ds
        self.pending_bytes += size
        lim = self.limits
        if len(self._pending) > self._conflate_at or self.pending_bytes > lim.max_pending_bytes:
            merged_list, merged = conflate(self._pending)
            if merged:
                c["conflations"] = c.get("conflations", 0) + merged
                self._pending = merged_list
                self.pending_bytes = sum(len(d.data) for d in merged_list)
            self._conflate_at = len(self._pending) + max(lim.queue_frames // 4, 1)
            if len(self._pending) > lim.hard_limit_frames:
                return self._slow(f"more than {lim.hard_limit_frames} frames pending after merging")
            if self.pending_bytes > lim.max_pending_bytes:
                return self._slow(f"more than {lim.max_pending_bytes} bytes pending after merging")
        return _NONE

    def _slow(self, reason: str) -> Sequence[Intent]:
        self.counters["slow_disconnects"] = self.counters.get("slow_disconnects", 0) + 1
        return self.close(CloseCode.SLOW_CONSUMER, reason)
