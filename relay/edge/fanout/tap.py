"""The I/O around one :class:`relay.edge.core.watch.Watch`: backlog reads, the socket, wake-ups.

A :class:`Tap` is what :meth:`relay.edge.fanout.hub.Hub.watch` returns. The hub feeds it live frames
synchronously on its reader (:meth:`Tap.feed`); the tap runs the pure watch and performs
its intents: a :class:`relay.edge.core.resume.Fetch` becomes a backlog page read (bounded in frames
and bytes, under the relay-wide :class:`ByteBudget` for replay pages in memory), a
:class:`relay.edge.core.watch.Closed` wakes the consumer and detaches the tap from the hub.

Two consumers:

- a socket (:meth:`Tap.run` with an :class:`Out`, in the stream's task; or
  :meth:`Tap.attach`, with no task waiting: a WebSocket's handler task reads the
  client, and a task runs :meth:`Tap.drain` only when the tap calls for one): the fast
  path writes frames straight from the hub's reader to the transport while it has room
  (no task switch): the frames a socket got from one read chunk go out in one write, by
  a :class:`Flusher` callback that runs right after the reader has parsed the chunk; a
  socket that pushes back (transport above its write high-water mark) keeps its frames
  queued in the watch (conflation, slow-consumer cutoff), drained by the stream's task
  when the transport resumes;
- plain code and tests (:meth:`Tap.next`): everything pending, awaited.

The next replay page is read when the watch says its queue is below low water, that is
after the socket took the previous page: a replay runs at the socket's speed.

Order of use (the hub does the first two)::

    tap = Tap(sid, watch, hub); tap.subscribed()   # hub: a TapHost
    tap.feed(deliveries)                       # hub reader, per live chunk
    await tap.run(out)  /  await tap.next()    # raise WatchClosed(reason, code)
    tap.attach(out, waker)                     # or: waker() starts a task: await tap.drain()
    await tap.close()
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError, WatchClosed
from relay.broker.rediscluster.publisher import BacklogPage, read_backlog_page
from relay.edge.core.resume import Delivery, Fetch
from relay.edge.core.watch import Closed, Intent, Watch
from relay.protocol.codes import CloseCode
from relay.protocol.frame import FrameError, decode, frame_gen
from relay.service.supervise import QUICK_BACKOFF

__all__ = ["ByteBudget", "Flusher", "Out", "Tap", "TapHost", "delivery", "read_page"]


log = logging.getLogger(__name__)


def delivery(data: bytes, received_mono_ms: int = 0) -> Delivery | None:
    """A :class:`Delivery` for one frame's bytes, or None (logged) if it does not decode."""
    try:
        f = decode(data)
    except FrameError as exc:
        log.warning("dropping undecodable frame: %s", exc)
        return None
    return Delivery(f.offset, f.kind, data, f.ts, received_mono_ms, frame_gen(f))


async def read_page(
    redis: RedisCluster,
    sid: str,
    after: int | None,
    count: int,
    max_bytes: int,
    alive: Callable[[], bool],
) -> BacklogPage | None:
    """One backlog read (``after`` None: bounds only), retried with jittered backoff
    while Redis is unreachable and ``alive()``; None once not alive."""
    failures = 0
    while alive():
        try:
            return await read_backlog_page(
                redis, sid, after or 0, count if after is not None else 0, max_bytes
            )
        except RelayError as exc:
            failures += 1
            log.info("backlog read for %s failed: %s", sid, exc)
            await asyncio.sleep(QUICK_BACKOFF.delay(failures))
    return None


class ByteBudget:
    """A relay-wide budget of bytes (replay pages in memory). :meth:`acquire` waits its
    turn, first come first served, when the budget is spent; it never refuses."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte budget must be >= 1")
        self.total = total
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, n: int) -> int:
        """Reserve ``n`` bytes (at most the whole budget); return what was reserved."""
        n = max(min(n, self.total), 0)
        if not self._waiters and self.used + n <= self.total:
            self._take(n)
            return n
        self.waits += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted while we were being cancelled
            else:
                self._waiters.remove(entry)
                self._grant()
            raise
        return n

    def release(self, n: int) -> None:
        self.used = max(self.used - n, 0)
        self._grant()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)


class Out(Protocol):
    """A socket as the tap sees it (see :mod:`relay.edge.conn.streams`)."""

    def room(self) -> bool:
        """True while the transport is open and below its write high-water mark."""

    def send(self, ds: list[Delivery]) -> None:
        """Write these frames now, pre-encoded, in one transport write."""

    async def drain(self) -> None:
        """Wait until the transport has room again (raise ConnectionError if it is gone)."""


class Flusher:
    """Taps fed during one read chunk, written once each when the chunk is done. The
    hub brackets each chunk of a shard connection with :meth:`hold` / :meth:`release`
    (the writes follow the chunk's parse at once, chunk by chunk); taps fed outside a
    chunk (backlog pages) are written by one ``call_soon``."""

    def __init__(self) -> None:
        self._dirty: list[Tap] = []
        self._scheduled = False
        self._holding = False
        # its loop, kept: asyncio.get_running_loop() makes a getpid() system call
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, tap: Tap) -> None:
        self._dirty.append(tap)
        if not self._scheduled and not self._holding:
            self._scheduled = True
            loop = self._loop
            if loop is None:
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._scheduled_run)

    def hold(self) -> None:
        """A chunk is being read: write its taps at :meth:`release`."""
        self._holding = True

    def release(self) -> None:
        self._holding = False
        if self._dirty:
            self._run()

    def _scheduled_run(self) -> None:
        self._scheduled = False
        self._run()

    def _run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for tap in dirty:
            tap._dirty = False
            tap._flush()


class TapHost(Protocol):
    """What a tap needs of its hub: one reference per tap, not one per callback."""

    @property
    def redis(self) -> RedisCluster: ...

    @property
    def budget(self) -> ByteBudget: ...

    @property
    def flusher(self) -> Flusher | None: ...

    def tap_closed(self, tap: Tap) -> None:
        """The tap's watch closed: stop feeding it."""

    def offsets_lost(self, sid: str, seen: int) -> None:
        """The backlog ends before ``seen``, an offset already delivered (a failover)."""


class Tap:
    """One watcher as the hub and the server see it. See the module docstring."""

    __slots__ = (
        "_detached",
        "_dirty",
        "_fetch_task",
        "_held",
        "_host",
        "_out",
        "_waiter",
        "_waker",
        "session",
        "watch",
    )

    def __init__(self, sid: str, watch: Watch, host: TapHost) -> None:
        self.session = sid
        self.watch = watch
        self._host = host
        self._dirty = False
        self._waiter: asyncio.Future[None] | None = None  # made only while a consumer waits
        self._out: Out | None = None
        self._waker: Callable[[], None] | None = None  # an attached consumer's (attach)
        self._fetch_task: asyncio.Task[None] | None = None
        self._held = 0  # budget bytes of replay frames read and not yet taken
        self._detached = False

    @property
    def closed(self) -> bool:
        return self.watch.closed is not None

    @property
    def pending(self) -> int:
        return self.watch.pending

    # -- driven by the hub -------------------------------------------------------------

    def subscribed(self) -> None:
        """The channel is subscribed: ask for the replay (or the bounds) in the background."""
        self._apply(self.watch.subscribed())

    def feed(self, ds: list[Delivery]) -> None:
        """Live frames in channel order (synchronous, on the hub's reader)."""
        watch = self.watch
        intents = watch.live(ds)
        if intents:
            self._apply(intents)
        if not self._dirty and watch.pending:
            flusher = self._host.flusher
            if flusher is not None and self._out is not None:
                self._dirty = True
                flusher.add(self)
            else:
                self._flush()

    def shut(self, reason: str, code: CloseCode) -> None:
        self._apply(self.watch.close(code, reason))

    async def close(self) -> None:
        self.shut("watch closed", CloseCode.CLOSED)

    async def first_read(self) -> None:
        """Wait until the first backlog answer (the replay's start or the bounds) is in."""
        task = self._fetch_task
        if task is not None:
            await asyncio.shield(task)

    # -- consumers ---------------------------------------------------------------------

    async def next(self) -> list[Delivery]:
        """Wait for at least one delivery; return everything pending, in order."""
        while True:
            closed = self.watch.closed
            if closed is not None:
                raise WatchClosed(closed.reason, closed.code)
            if self.watch.pending:
                ds = self._take()
                self._settle(None)
                return ds
            await self._wait()

    async def run(self, out: Out, *, idle_returns: bool = False) -> None:
        """Write to ``out`` until the watch closes (raises WatchClosed) or the socket fails
        (ConnectionError from ``out``). Frames go straight out from the hub's reader while
        ``out`` has room; this task only drains what a pushing-back socket left queued.
        With ``idle_returns`` (:meth:`drain`), return once nothing is queued."""
        self._out = out
        loop = asyncio.get_running_loop()
        try:
            while True:
                closed = self.watch.closed
                if closed is not None:
                    raise WatchClosed(closed.reason, closed.code)
                if not self.watch.pending:
                    if idle_returns:
                        return
                    self._waiter = waiter = loop.create_future()  # (not self._wait():
                    try:  # one coroutine less held by every idle stream)
                        await waiter
                    finally:
                        self._waiter = None
                elif not out.room():
                    await out.drain()
                    self._settle(out)
                else:
                    self._send(out, "writes_queued")
        except BaseException:
            self._out = self._waker = None
            raise

    def attach(self, out: Out, waker: Callable[[], None]) -> None:
        """Write to ``out`` straight from the hub's reader, with no task of the consumer's
        waiting meanwhile: ``waker()`` is called when one is needed, that is when the
        socket pushed back with frames queued or the watch closed; it must start a task
        that runs :meth:`drain`."""
        self._out, self._waker = out, waker
        if self.closed:
            waker()
        elif self.watch.pending:
            self._flush()

    async def drain(self) -> None:
        """For an attached consumer (:meth:`attach`): write what is queued as the socket
        drains and return once nothing is; raise like :meth:`run` when the watch closed
        or the socket failed."""
        out = self._out
        if out is None:
            raise WatchClosed("the stream has ended", CloseCode.CLOSED)
        await self.run(out, idle_returns=True)

    def try_write(self, write: Callable[[], None]) -> bool:
        """Run ``write`` (a heartbeat) only if nothing is queued and the socket has room."""
        out = self._out
        if out is None or self.watch.pending or self.closed or not out.room():
            return False
        write()
        return True

    # -- internals ---------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            if not w.done():
                w.set_result(None)
        elif self._waker is not None:
            self._waker()

    def _take(self) -> list[Delivery]:
        """Everything pending; performs the watch's intents (the next replay page)."""
        ds, intents = self.watch.take()
        if intents:
            self._apply(intents)
        return ds

    def _send(self, out: Out, counter: str) -> None:
        watch = self.watch
        ds, intents = watch.take()
        if ds:
            out.send(ds)
            c = watch.counters
            c[counter] = c.get(counter, 0) + 1
        if self._held:
            self._settle(out)  # before the next page is asked for: its budget may be ours
        if intents:
            self._apply(intents)

    def _settle(self, out: Out | None) -> None:
        """Replay bytes stop counting against the budget once the transport took them
        below its high-water mark (or a plain consumer took them)."""
        if self._held and (out is None or out.room()):
            self._host.budget.release(self._held)
            self._held = 0

    def _flush(self) -> None:
        out = self._out
        if out is not None and out.room():
            self._send(out, "writes_direct")
        else:
            self._wake()

    def _apply(self, intents: Iterable[Intent]) -> None:
        for it in intents:
            if isinstance(it, Closed):
                self._closed()
            else:
                self._fetch_task = asyncio.create_task(
                    self._fetch(it), name=f"replay:{self.session}"
                )
                self._fetch_task.add_done_callback(_consume)

    def _closed(self) -> None:
        self._wake()
        if self._held:
            self._host.budget.release(self._held)
            self._held = 0
        task, self._fetch_task = self._fetch_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if not self._detached:
            self._detached = True
            self._host.tap_closed(self)

    async def _fetch(self, fetch: Fetch) -> None:
        w = self.watch
        lim = w.limits
        replay = fetch.after is not None
        reserved = await self._host.budget.acquire(lim.replay_page_bytes) if replay else 0
        try:
            page = await read_page(
                self._host.redis,
                self.session,
                fetch.after,
                lim.replay_page_frames,
                lim.replay_page_bytes,
                lambda: not self.closed,
            )
        except BaseException:
            self._host.budget.release(reserved)
            raise
        if page is None or self.closed:
            self._host.budget.release(reserved)
            return
        frames, first, last, gen = page
        size = sum(len(f) for f in frames)
        keep = min(size, reserved)
        self._host.budget.release(reserved - keep)
        self._held += keep
        r = w.resume
        if r.started and r.last is not None and last < r.last:
            self._host.offsets_lost(self.session, r.last)  # a failover lost offsets we delivered
        entries = [d for d in map(delivery, frames) if d is not None]
        if self._fetch_task is asyncio.current_task():
            self._fetch_task = None
        self._apply(w.backlog(entries, first, last, gen))
        if w.pending:
            self._flush()


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("backlog read task failed", exc_info=task.exception())
