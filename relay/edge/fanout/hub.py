"""The relay's fan-out: one subscription per session, any number of local connections,
each resumed from its own offset.

The broker (:class:`relay.broker.base.Broker`) hands the live messages of each read to
:meth:`Hub._on_message`, synchronously: the reader never awaits a consumer. Per
session channel, a :class:`relay.edge.core.resume.Resume` keeps the channel's order
(duplicates dropped; a hole -> one backlog read for all its connections, a repair).
After the whole read is parsed, each channel's frames of that read go to each of its
connections in one call (:meth:`relay.edge.conn.base.Conn.feed`), so a socket gets one
write per read. A connection merges its own replay with that feed and writes to its
socket (:mod:`relay.edge.conn.base`); its backlog pages come from :meth:`Hub.read_page`,
under the relay-wide :class:`relay.edge.fanout.budget.ByteBudget`.

The path of a live frame is therefore: the broker's reader, this module (decode, the
channel's order, the hand-off), the connection (its fast path writes at once); then,
off that path, :attr:`Hub.tap`. No module is entered twice (``bench.relay.anatomy``).

Beside the fan-out, fed by the set of watched sessions: the broker's presence (a
session's first local connection opens it, its last one closes it), the screen counts
(:class:`relay.edge.fanout.notices.PresenceWriter`: written when they change; the ``presence``
frames that come back go to the session's connections, outside its order) and
:class:`relay.edge.fanout.reaper.Reaper` (ends turns whose producer died).

A deleted session (its notice, or a read that finds its tombstone) ends every
connection of it with the notice as its last frame, and its channel goes at once
(:meth:`Hub._gone`). Notices are looked at only where a frame is not the channel's next
one: the live path's common case does not pay for them.

Background work runs on one :class:`relay.service.supervise.Supervisor` (the relay's, or
the hub's own): the broker's loops, the reaper, every task the hub or a connection
starts (subscribes, backlog reads, seals, socket writers); failures are logged, not lost.

Reference counts without races (centrifuge ``node.go``): the first connection of a
session subscribes (the others await the same future; a failure rolls back); the last
one leaving schedules an unsubscribe after ``unsubscribe_delay_s``, re-checking the count.

Order of use::

    hub = Hub(broker, relay_id="edge-1"); await hub.start()
    await hub.open(conn)        # a relay.edge.conn.base.Conn: subscribe, then its replay
    ...                         # conn.shut(...) leaves; hub.conn_closed(conn) is called
    await hub.close()           # with Hub(..., supervisor=s): stop s before this
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, NamedTuple

from relay.broker.base import Broker
from relay.broker.errors import RelayError, SessionDeleted, WatchClosed
from relay.edge.core.resume import Delivery, Fetch, ResumeState, Step
from relay.edge.core.watch import Limits
from relay.edge.fanout.budget import ByteBudget
from relay.edge.fanout.channel import Channel, Watcher
from relay.edge.fanout.notices import DELETED_REASON, PresenceWriter, deleted_delivery, is_deleted
from relay.edge.fanout.reaper import Reaper
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, FrameError, decode, frame_gen, monotonic_ms
from relay.protocol.keys import parse_session
from relay.service.supervise import QUICK_BACKOFF, Supervisor

__all__ = ["Hub", "Page"]

log = logging.getLogger(__name__)


class Page(NamedTuple):
    """A backlog page, decoded: deliveries, their bytes, first offset held, last written,
    the session's generation, the deliveries' frames (a compacted join merges them)."""

    entries: list[Delivery]
    size: int
    first: int
    last: int
    gen: str
    frames: list[Frame]


_COUNTERS = (
    "watches_opened", "frames_in", "reads", "frames_out", "bad_frames", "conflations",
    "slow_disconnects", "replays", "gaps", "duplicates", "repairs", "subscribes",
    "unsubscribes", "sealed", "writes_direct", "writes_queued", "deleted", "compacted",
)  # fmt: skip


class Hub:
    """Fan-out of session channels to local connections. See the module docstring.

    Bounds: ``queue_frames`` / ``hard_limit_frames`` / ``max_pending_bytes`` per
    connection (conflation, then ``slow_consumer``); ``backlog_page`` frames and
    ``page_bytes`` bytes per backlog read; ``replay_budget_bytes`` of replay pages in
    memory relay-wide (past it new replays wait their turn); ``screens_interval_s``: the
    least time between two writes of a session's screen count (0: no counts, no presence
    frames)."""

    def __init__(
        self,
        broker: Broker,
        *,
        queue_frames: int = 1024,
        hard_limit_frames: int = 4096,
        max_pending_bytes: int = 1 << 20,
        unsubscribe_delay_s: float = 2.0,
        backlog_page: int = 512,
        page_bytes: int = 256 * 1024,
        replay_budget_bytes: int = 64 << 20,
        reap_after_s: float = 2.0,
        reap_interval_s: float = 1.0,
        screens_interval_s: float = 1.0,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.broker = broker
        self.relay_id = broker.relay_id
        self._owns_supervisor = supervisor is None
        self.supervisor = supervisor or Supervisor(backoff=QUICK_BACKOFF)
        self.limits = Limits(
            queue_frames=queue_frames,
            hard_limit_frames=hard_limit_frames,
            max_pending_bytes=max_pending_bytes,
            page_frames=backlog_page,
            page_bytes=page_bytes,
        )
        self.unsubscribe_delay_s = unsubscribe_delay_s
        self.backlog_page = backlog_page
        self.budget = ByteBudget(replay_budget_bytes)
        self.reaper = Reaper(
            broker, self._reapable, reap_after_s=reap_after_s, interval_s=reap_interval_s
        )
        self._channels: dict[str, Channel] = {}
        self._by_key: dict[bytes, Channel] = {}
        self._sealing: set[str] = set()
        self._closed = False
        # called with the live frames of each read (servers time publish -> edge here,
        # once per frame, not once per socket)
        self.live_observers: list[Callable[[list[Delivery]], None]] = []
        # every read's raw messages after the fan-out (the Durable Streams wake-ups)
        self.tap: Callable[[list[list[bytes]]], None] | None = None
        # plain counters the hub, its connections and their watches add to
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.screens = PresenceWriter(
            broker, self._watched, self._spawn, interval_s=screens_interval_s,
            counters=self.counters,
        )  # fmt: skip
        broker.bind(self._on_message, self._on_resubscribed, self.screens.recount)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.broker.start(self.supervisor)
        self.reaper.start(self.supervisor)

    async def close(self) -> None:
        """Tell every connection the relay shuts down, stop the background work (a
        supervisor given to the constructor must be stopped before), close the broker
        (which removes this relay's presence)."""
        if self._closed:
            return
        self._closed = True
        for ch in list(self._channels.values()):
            for w in ch.watchers():
                w.shut("the relay is shutting down", CloseCode.RELAY_SHUTDOWN)
        for ch in list(self._channels.values()):
            self._drop_channel(ch)
        if self._owns_supervisor:
            await self.supervisor.stop()
        await self.screens.close()  # its counts back to 0, before its presence goes
        await self.broker.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(self.broker.stats())
        out.update(self.reaper.stats)
        out["watches"] = sum(ch.watched for ch in self._channels.values())
        out["channels"] = len(self._channels)
        out["replay_budget_used"] = self.budget.used
        out["replay_budget_peak"] = self.budget.peak
        out["replay_budget_waits"] = self.budget.waits
        return out

    # -- connections -------------------------------------------------------------------

    async def open(self, w: Watcher) -> None:
        """Subscribe (shared), then start ``w``'s replay after its offset (page by page,
        as it takes frames) and feed it live. Live only (offset None): returns once the
        backlog's bounds are read.

        Raises :class:`relay.broker.errors.SubscribeError` if the channel cannot be
        subscribed (after the broker's timeout), :class:`relay.broker.errors.SessionDeleted`
        if the session was deleted (the channel's first read, or a live-only watch's own,
        found its tombstone). Backlog reads are retried while the store is unreachable:
        wrap the call in ``asyncio.timeout`` to bound the wait.
        """
        if self._closed:
            raise WatchClosed("the relay is shutting down", CloseCode.RELAY_SHUTDOWN)
        sid = parse_session(w.sid)
        if w.offset is not None and w.offset < 0:
            raise ValueError("the offset must be >= 0 or None")
        ch = self._channels.get(sid)
        if ch is None:
            ch = self._open_channel(sid)
        if ch.unsub_handle is not None:
            ch.unsub_handle.cancel()
            ch.unsub_handle = None
        ch.add(w)  # counted (and fed live frames) before any await
        self.counters["watches_opened"] += 1
        try:
            await asyncio.shield(ch.ready)
            if w.offset is not None:
                self.counters["replays"] += 1
            w.subscribed()
            if w.offset is None:
                await w.first_read()
        except BaseException:
            w.shut("watch setup failed", CloseCode.CLOSED)
            raise
        if w.stop is not None and w.stop[0] is CloseCode.SESSION_DELETED:
            raise SessionDeleted(sid)  # its first read found the tombstone
        if not w.closed:
            self.broker.present(sid)  # a no-op unless this is the session's first watcher
            self.screens.joined(ch, w)

    def conn_closed(self, w: Watcher) -> None:
        """``w``'s watch closed: stop feeding it; the last one leaving unsubscribes later."""
        ch = self._channels.get(w.sid)
        if ch is None or not ch.discard(w):
            return
        if not self._closed:
            self.screens.changed(ch.sid)
        if ch.watched or ch.dead or self._closed:
            return
        self.broker.absent(ch.sid)
        loop = asyncio.get_running_loop()
        ch.unsub_handle = loop.call_later(self.unsubscribe_delay_s, self._maybe_unsubscribe, ch)

    def offsets_lost(self, sid: str, seen: int) -> None:
        """A connection's backlog read ends before ``seen`` (delivered): seal the range."""
        self._seal_later(sid, seen)

    async def read_page(
        self, sid: str, after: int | None, count: int, max_bytes: int, alive: Callable[[], bool]
    ) -> Page | None:
        """One backlog read, decoded (``after`` None: the bounds only), retried with
        jittered backoff while the store is unreachable and ``alive()``; None once not;
        :class:`SessionDeleted` once this relay's streams of it were ended (:meth:`_gone`)."""
        failures = 0
        while alive():
            try:
                page = await self.broker.read_page(sid, after, count, max_bytes)
            except SessionDeleted:
                ch = self._channels.get(sid)
                if ch is not None:
                    self._gone(ch, deleted_delivery(sid))
                raise
            except RelayError as exc:
                failures += 1
                log.info("backlog read for %s failed: %s", sid, exc)
                await asyncio.sleep(QUICK_BACKOFF.delay(failures))
                continue
            entries: list[Delivery] = []
            frames: list[Frame] = []
            size = 0
            for data in page.frames:
                size += len(data)
                try:
                    f = decode(data)
                except FrameError as exc:
                    self.counters["bad_frames"] += 1
                    log.warning("backlog of %s: dropping an undecodable frame: %s", sid, exc)
                    continue
                entries.append(Delivery(f.offset, f.kind, data, f.ts, 0, frame_gen(f)))
                frames.append(f)
            return Page(entries, size, page.first, page.last, page.gen, frames)
        return None

    # -- channels ----------------------------------------------------------------------

    def _open_channel(self, sid: str) -> Channel:
        ch = Channel(sid, self.broker.channel(sid))
        self._channels[sid] = ch
        self._by_key[ch.key] = ch
        self._spawn(f"subscribe:{sid}", self._subscribe_channel(ch))
        return ch

    async def _subscribe_channel(self, ch: Channel) -> None:
        try:
            await self.broker.subscribe(ch.sid)
            self.counters["subscribes"] += 1
            step = ch.resume.subscribed()  # channel level: start at the current end
            await self._fetch_loop(ch, step.fetch)
        except BaseException as exc:  # roll back; every waiting connection gets the error
            self._drop_channel(ch)
            if not ch.ready.done():
                ch.ready.set_exception(exc if isinstance(exc, Exception) else RelayError("closed"))
            if not isinstance(exc, Exception):
                raise
            return
        if not ch.ready.done():
            ch.ready.set_result(None)

    def _maybe_unsubscribe(self, ch: Channel) -> None:
        ch.unsub_handle = None
        if ch.watched or self._channels.get(ch.sid) is not ch:
            return  # someone came back during the delay
        self._drop_channel(ch)

    def _drop_channel(self, ch: Channel) -> None:
        if ch.dead:
            return
        ch.dead = True
        if ch.unsub_handle is not None:
            ch.unsub_handle.cancel()
        if self._channels.get(ch.sid) is ch:
            del self._channels[ch.sid]
            self._by_key.pop(ch.key, None)
        if ch.resume.state is not ResumeState.CLOSED:
            ch.resume.close()
        if ch.fetch_task is not None and ch.fetch_task is not asyncio.current_task():
            ch.fetch_task.cancel()
        self.counters["unsubscribes"] += 1
        if not self._closed:  # on close, the broker's connections close anyway
            self.broker.unsubscribe(ch.sid)

    def _watched(self, sid: str) -> int:
        """The session's connections on this relay now."""
        ch = self._channels.get(sid)
        return ch.watched if ch is not None else 0

    def _reapable(self) -> Iterator[Channel]:
        return (ch for ch in self._channels.values() if ch.watched and ch.ready.done())

    # -- the live path (synchronous, called by the broker's reader) ----------------------

    def _on_message(self, msgs: list[list[bytes]]) -> None:
        """The live messages of one read, in order: per frame a decode and the channel's
        order; then per channel its frames of the read to each of its connections (one
        socket write each); then the counters and the observers. Written as one function
        on purpose: the path of a frame enters this module once."""
        counters, by_key = self.counters, self._by_key
        received, now = monotonic_ms(), time.monotonic()
        seen: list[Delivery] = []
        touched: list[Channel] = []
        for msg in msgs:
            ch = by_key.get(msg[1])
            if ch is None:
                continue
            data = msg[2]
            try:
                f = decode(data)
            except FrameError as exc:
                counters["bad_frames"] += 1
                log.warning("dropping an undecodable frame of %s: %s", ch.sid, exc)
                continue
            d = Delivery(f.offset, f.kind, data, f.ts, received, frame_gen(f))
            seen.append(d)
            try:
                if ch.resume.next_live(d):  # the common case: the next frame, in order
                    ds = [d]
                elif d.offset == 0 and d.kind == "presence":  # outside the order
                    self.screens.received(ch, d)
                    continue
                elif d.offset == 0 and is_deleted(f):
                    self._gone(ch, d)
                    continue
                else:
                    step = ch.resume.live(d)
                    if step.fetch is not None:
                        counters["repairs"] += 1
                        ch.fetch_task = self._spawn(
                            f"repair:{ch.sid}", self._fetch_loop(ch, step.fetch)
                        )
                    if not step.emit:
                        continue
                    ds = step.emit
            except Exception:  # one channel's bug must not cost the read's other frames
                log.exception("live frame of %s failed", ch.sid)
                continue
            if ch.batch is None:
                ch.batch = ds
                touched.append(ch)
            else:
                ch.batch += ds
        for ch in touched:
            ds, ch.batch = ch.batch or [], None
            for d in ds:  # what the reaper needs: is a turn open, when was it last heard
                k = d.kind
                if k == "token" or k == "part" or k == "meta":
                    ch.turn_open = True
                elif k == "done" or k == "error":
                    ch.turn_open = False
            ch.last_frame = now
            try:
                if ch.one is not None:
                    ch.one.feed(ds)
                elif ch.many is not None:
                    for w in list(ch.many):
                        w.feed(ds)
            except Exception:  # a connection's bug must not cost the other channels
                log.exception("fan-out of %s failed", ch.sid)
        counters["frames_in"] += len(seen)
        counters["reads"] += 1
        if seen:
            for observe in self.live_observers:
                observe(seen)
        if self.tap is not None:  # after the sockets' writes: off the frame's walk
            self.tap(msgs)

    def _fan_out(self, ch: Channel, ds: list[Delivery]) -> None:
        """Frames the channel emits outside a live read (a repair's backlog pages)."""
        now = time.monotonic()
        for d in ds:
            if d.kind == "token" or d.kind == "part" or d.kind == "meta":
                ch.turn_open = True
            elif d.kind == "done" or d.kind == "error":
                ch.turn_open = False
        ch.last_frame = now
        for w in ch.watchers():
            try:
                w.feed(ds)
            except Exception:
                log.exception("fan-out of %s failed", ch.sid)

    def _gone(self, ch: Channel, d: Delivery) -> None:
        """The session was deleted: the channel goes now (no linger: a stream opened
        after this reads the backlog, finds the tombstone and is refused), and every
        connection ends with ``d`` (the notice) as its last frame, then its goodbye."""
        watchers = ch.watchers()
        if ch.ready.done():  # streams it served (not only streams it refuses)
            self.counters["deleted"] += 1
        else:  # connections still opening: refused
            ch.ready.set_exception(SessionDeleted(ch.sid))
        self._drop_channel(ch)
        self.screens.forget(ch.sid)
        if not self._closed:
            self.broker.absent(ch.sid)
        for w in watchers:
            try:
                w.farewell(d, DELETED_REASON, CloseCode.SESSION_DELETED)
            except Exception:
                log.exception("ending a stream of the deleted session %s failed", ch.sid)

    def _on_resubscribed(self, sids: list[str]) -> None:
        for sid in sids:
            ch = self._channels.get(sid)
            if ch is not None and ch.ready.done():
                self._channel_step(ch, ch.resume.repair())

    def _channel_step(self, ch: Channel, step: Step) -> None:
        if step.emit:
            self._fan_out(ch, step.emit)
        if step.fetch is not None:
            self.counters["repairs"] += 1
            ch.fetch_task = self._spawn(f"repair:{ch.sid}", self._fetch_loop(ch, step.fetch))

    # -- backlog reads of a channel (holes and repairs, shared by all its connections) ---

    async def _fetch_loop(self, ch: Channel, fetch: Fetch | None) -> None:
        """Answer the channel resume's fetches until it needs none."""
        resume = ch.resume

        def alive() -> bool:
            return not ch.dead

        while fetch is not None and alive():
            try:
                page = await self.read_page(ch.sid, fetch.after, self.backlog_page, 0, alive)
            except SessionDeleted:  # the channel is gone, its connections ended (_gone)
                return
            if page is None:
                return
            if resume.started and resume.last is not None and page.last < resume.last:
                self._seal_later(ch.sid, resume.last, resume.gen)  # a failover lost offsets
            step = resume.backlog(page.entries, page.first, page.last, page.gen)
            if step.emit:
                self._fan_out(ch, step.emit)
            fetch = step.fetch

    def _seal_later(self, sid: str, seen: int, gen: str = "") -> None:
        if sid in self._sealing:
            return
        self._sealing.add(sid)

        async def run() -> None:  # a failure is logged by the supervisor
            try:
                n = await self.broker.seal(sid, seen, gen)
                if n:
                    self.counters["sealed"] += n
                    log.warning("session %s: %d offset(s) up to %d lost", sid, n, seen)
            finally:
                self._sealing.discard(sid)

        self._spawn(f"seal:{sid}", run())

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """A task of the hub: logged if it fails, cancelled when the supervisor stops."""
        return self.supervisor.spawn(name, coro)
