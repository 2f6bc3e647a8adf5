"""A session's local watcher and its bounded queue: what :class:`relay.hub.Hub` hands
to each SSE / WebSocket stream.

A :class:`Watch` gets its deliveries from the hub, synchronously, on the reader task
(``_live`` for live frames, ``_push`` for frames read back from the backlog); its own
:class:`relay.resume.Resume` merges the replay from the client's offset with the live
feed (in order, no gap, no duplicate). The stream awaits :meth:`Watch.next`, which
returns everything pending. The queue is bounded: past ``hub.queue_frames`` pending
frames, each run of consecutive token frames of one turn is merged into one frame
(:func:`conflate`, text only appends); past ``hub.hard_limit_frames`` after merging the
watch is closed with code ``slow_consumer``. The hub never waits on a watcher.

Order of use (the hub creates watches; streams only read them)::

    watch = await hub.watch(sid, from_offset)
    while True: deliveries = await watch.next()   # raises WatchClosed(reason, code)
    await watch.close()
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from relay.errors import WatchClosed
from relay.frame import Frame, decode, encode, first_offset, merge_tokens
from relay.resume import Delivery, Fetch, Resume

if TYPE_CHECKING:
    from relay.hub import Hub, _Channel

__all__ = ["Watch", "conflate"]


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
            out.append(Delivery(m.offset, "token", encode(m), last.ts, last.received_ms))
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


class Watch:
    """One local watcher of a session. Use :meth:`next` until it raises WatchClosed."""

    def __init__(self, hub: Hub, channel: _Channel, after: int | None) -> None:
        self.hub = hub
        self.session = channel.sid
        self._channel = channel
        self.resume = Resume(channel.sid, after, max_buffer=hub.hard_limit_frames)
        self._pending: deque[Delivery] = deque()
        self._wake = asyncio.Event()
        self._closed: WatchClosed | None = None
        self._fetch_task: asyncio.Task[None] | None = None
        self._conflate_at = hub.queue_frames

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def next(self) -> list[Delivery]:
        """Wait for at least one delivery; return everything pending, in order."""
        while True:
            if self._closed is not None:
                raise self._closed
            if self._pending:
                out = list(self._pending)
                self._pending.clear()
                self._conflate_at = self.hub.queue_frames
                self.hub._stats["frames_out"] += len(out)
                return out
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        self._shut("watch closed", "closed")

    # -- driven by the hub (synchronous) -----------------------------------------------

    def _live(self, ds: list[Delivery]) -> None:
        out: list[Delivery] = []
        for d in ds:
            step = self.resume.live(d)
            out.extend(step.emit)
            if step.fetch is not None:
                self._start_fetch(step.fetch)
        if out:
            self._push(out)

    def _start_fetch(self, fetch: Fetch) -> None:
        self.hub._stats["repairs"] += 1
        self._fetch_task = asyncio.create_task(
            self.hub._fetch_loop(self.session, self.resume, fetch, self._push, self._alive)
        )

    def _alive(self) -> bool:
        return self._closed is None

    def _push(self, ds: list[Delivery]) -> None:
        if self._closed is not None or not ds:
            return
        hub = self.hub
        hub._stats["gaps"] += sum(1 for d in ds if d.kind == "gap")
        self._pending.extend(ds)
        if len(self._pending) > self._conflate_at:
            merged_list, merged = conflate(self._pending)
            if merged:
                hub._stats["conflations"] += merged
                self._pending = deque(merged_list)
            self._conflate_at = len(self._pending) + max(hub.queue_frames // 4, 1)
            if len(self._pending) > hub.hard_limit_frames:
                hub._stats["slow_disconnects"] += 1
                self._shut(
                    f"more than {hub.hard_limit_frames} frames pending after merging",
                    "slow_consumer",
                )
                return
        self._wake.set()

    def _shut(self, reason: str, code: str) -> None:
        if self._closed is not None:
            return
        self._closed = WatchClosed(reason, code)
        self._pending.clear()
        self.resume.close()
        self._wake.set()
        task, self._fetch_task = self._fetch_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self.hub._detach(self)
