"""The per-relay fan-out that the edge server uses: one subscription per session,
any number of local watchers, each resumed from its own offset, each with a bounded queue.

Pieces: :class:`relay.subscriber.ShardedSubscriber` (one pubsub connection per node)
hands every ``smessage`` to :meth:`Hub._on_message` (synchronous: the reader task never
awaits a consumer). Per channel, a :class:`relay.resume.Resume` keeps channel-level
order (duplicates dropped; a hole -> one backlog read for all watchers); per watcher,
a :class:`relay.watch.Watch` merges that watcher's replay with the live feed in its
own bounded queue: past ``queue_frames`` pending frames, token runs are merged; past
``hard_limit_frames`` the watcher is closed with code ``slow_consumer``.

Reference counts without races (centrifuge ``node.go``): the first watcher of a session
subscribes (all other watchers await the same future; a failure rolls back); the last
one leaving schedules an unsubscribe after ``unsubscribe_delay_s`` that re-checks the
count. Worker death: a watched channel whose turn is open (its last frame was not
``done``/``error``) and silent for ``reap_after_s`` gets :func:`relay.publisher.reap`
(every ``reap_interval_s``, off the reader task): once the worker's turn lock has
expired, the turn ends with an ``error`` frame "worker lost", written exactly once
whichever relay gets there first. Presence: one background task refreshes
``presence_key(sid)`` (member ``relay_id``, score now in ms) every
``presence_interval_s`` for every watched session, batched in one cluster pipeline,
and removes the member when the last local watcher leaves.

Order of use::

    hub = Hub(redis, relay_id="edge-1"); await hub.start()
    watch = await hub.watch(sid, from_offset)   # None: live only; 0: whole backlog; n: after n
    while True: deliveries = await watch.next() # raises WatchClosed(reason, code)
    await watch.close(); await hub.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster

from relay.errors import RelayError, WatchClosed, map_redis_errors
from relay.frame import FrameError, decode, frame_gen, now_ms
from relay.keys import live_channel, parse_session, presence_key
from relay.publisher import read_backlog, reap, seal
from relay.resume import Delivery, Fetch, Resume, Step
from relay.subscriber import ShardedSubscriber
from relay.watch import Watch, conflate

__all__ = ["Delivery", "Hub", "Watch", "WatchClosed", "conflate"]

log = logging.getLogger(__name__)

_PRESENCE_CHUNK = 500  # sessions per presence pipeline (2 commands each)

Sink = Callable[[list[Delivery]], None]


def _delivery(data: bytes, received_ms: int = 0) -> Delivery | None:
    try:
        f = decode(data)
    except FrameError as exc:
        log.warning("dropping undecodable frame: %s", exc)
        return None
    return Delivery(f.offset, f.kind, data, f.ts, received_ms, frame_gen(f))


class _Channel:
    """Hub state of one subscribed session channel."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.name = live_channel(sid)
        self.watches: set[Watch] = set()
        self.resume = Resume(sid, None)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.dead = False
        self.unsub_handle: asyncio.TimerHandle | None = None
        self.fetch_task: asyncio.Task[None] | None = None
        # reaper state: a turn may be open until a done/error frame says otherwise
        self.turn_open = True
        self.last_frame = time.monotonic()
        self.reap_next = 0.0
        self.reaping = False

    def saw(self, ds: list[Delivery]) -> None:
        for d in ds:
            if d.kind in ("done", "error"):
                self.turn_open = False
            elif d.kind in ("token", "meta"):
                self.turn_open = True
        self.last_frame = time.monotonic()

    def alive(self) -> bool:
        return not self.dead


class Hub:
    """Fan-out of session channels to local watchers. See the module docstring."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        queue_frames: int = 1024,
        hard_limit_frames: int = 4096,
        unsubscribe_delay_s: float = 2.0,
        relay_id: str,
        read_from_replicas: bool = False,
        backlog_page: int = 512,
        presence_interval_s: float = 1.0,
        presence_ttl_s: float = 10.0,
        reap_after_s: float = 2.0,
        reap_interval_s: float = 1.0,
        backlog_maxlen: int = 10_000,
        session_ttl_s: int = 86_400,
    ) -> None:
        if not 0 < queue_frames <= hard_limit_frames:
            raise ValueError("need 0 < queue_frames <= hard_limit_frames")
        self.redis = redis
        self.queue_frames = queue_frames
        self.hard_limit_frames = hard_limit_frames
        self.unsubscribe_delay_s = unsubscribe_delay_s
        self.relay_id = relay_id
        self.backlog_page = backlog_page
        self.presence_interval_s = presence_interval_s
        self.presence_ttl_s = presence_ttl_s
        self.reap_after_s = reap_after_s
        self.reap_interval_s = reap_interval_s
        self.backlog_maxlen = backlog_maxlen
        self.session_ttl_s = session_ttl_s
        self.subscriber = ShardedSubscriber(
            redis,
            on_message=self._on_message,
            on_resubscribed=self._on_resubscribed,
            relay_id=relay_id,
            read_from_replicas=read_from_replicas,
        )
        self._channels: dict[str, _Channel] = {}
        self._by_bytes: dict[bytes, _Channel] = {}
        self._presence_gone: set[str] = set()
        self._presence_new: set[str] = set()  # watched since the last flush: write at once
        self._presence_kick = asyncio.Event()
        self._presence_task: asyncio.Task[None] | None = None
        self._reaper_task: asyncio.Task[None] | None = None
        self._sealing: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # called once per live frame read from Redis (servers time publish -> edge here,
        # once per frame, not once per socket)
        self.live_observers: list[Callable[[Delivery], None]] = []
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "watches_opened",
                "frames_in",
                "frames_out",
                "bad_frames",
                "conflations",
                "slow_disconnects",
                "replays",
                "gaps",
                "repairs",
                "subscribes",
                "unsubscribes",
                "presence_errors",
                "presence_writes",
                "reap_checks",
                "reaped",
                "reap_errors",
                "sealed",
            ),
            0,
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.subscriber.start()
        self._presence_task = asyncio.create_task(self._presence_loop(), name="hub-presence")
        if self.reap_interval_s > 0:
            self._reaper_task = asyncio.create_task(self._reaper_loop(), name="hub-reaper")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._presence_gone.update(self._channels)
        for ch in list(self._channels.values()):
            for w in list(ch.watches):
                w._shut("the relay is shutting down", "relay_shutdown")
        for ch in list(self._channels.values()):
            self._drop_channel(ch)
        for bg in (self._presence_task, self._reaper_task):
            if bg is not None:
                bg.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await bg
        with contextlib.suppress(Exception):
            await self._presence_flush()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.subscriber.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out["watches"] = sum(len(ch.watches) for ch in self._channels.values())
        out["channels"] = len(self._channels)
        out["channels_per_node"] = self.subscriber.channels_per_node()
        out["resubscribes"] = self.subscriber.stats["resubscribes"]
        out["subscriber"] = dict(self.subscriber.stats)
        return out

    # -- watchers ----------------------------------------------------------------------

    async def watch(self, sid: str, from_offset: int | None) -> Watch:
        """Subscribe (shared), replay after ``from_offset``, then follow live.

        Raises :class:`relay.errors.SubscribeError` if the channel cannot be subscribed
        (after the subscriber's timeout). Backlog reads are retried while Redis is
        unreachable: wrap the call in ``asyncio.timeout`` to bound the wait.
        """
        if self._closed:
            raise WatchClosed("the relay is shutting down", "relay_shutdown")
        sid = parse_session(sid)
        if from_offset is not None and from_offset < 0:
            raise ValueError("from_offset must be >= 0 or None")
        ch = self._channels.get(sid)
        if ch is None:
            ch = self._open_channel(sid)
        if ch.unsub_handle is not None:
            ch.unsub_handle.cancel()
            ch.unsub_handle = None
        self._presence_gone.discard(sid)
        w = Watch(self, ch, from_offset)
        ch.watches.add(w)  # counted (and fed live frames) before any await
        self._stats["watches_opened"] += 1
        try:
            await asyncio.shield(ch.ready)
            if from_offset is not None:
                self._stats["replays"] += 1
            step = w.resume.subscribed()
            await self._fetch_loop(sid, w.resume, step.fetch, w._push, w._alive)
        except BaseException:
            w._shut("watch setup failed", "closed")
            raise
        if len(ch.watches) == 1:  # a newly watched session: announce it now, alone
            self._presence_new.add(sid)
            self._presence_kick.set()
        return w

    def _open_channel(self, sid: str) -> _Channel:
        ch = _Channel(sid)
        self._channels[sid] = ch
        self._by_bytes[ch.name.encode()] = ch
        self._spawn(self._subscribe_channel(ch))
        return ch

    async def _subscribe_channel(self, ch: _Channel) -> None:
        try:
            await self.subscriber.subscribe([ch.name])
            self._stats["subscribes"] += 1
            step = ch.resume.subscribed()  # channel level: start at the current end
            await self._fetch_loop(ch.sid, ch.resume, step.fetch, self._fanout(ch), ch.alive)
        except BaseException as exc:  # roll back; every waiting watcher gets the error
            self._drop_channel(ch)
            if not ch.ready.done():
                ch.ready.set_exception(exc if isinstance(exc, Exception) else RelayError("closed"))
            if not isinstance(exc, Exception):
                raise
            return
        if not ch.ready.done():
            ch.ready.set_result(None)

    def _detach(self, w: Watch) -> None:
        ch = w._channel
        ch.watches.discard(w)
        if ch.watches or ch.dead or self._closed:
            return
        self._presence_gone.add(ch.sid)
        self._presence_kick.set()
        loop = asyncio.get_running_loop()
        ch.unsub_handle = loop.call_later(self.unsubscribe_delay_s, self._maybe_unsubscribe, ch)

    def _maybe_unsubscribe(self, ch: _Channel) -> None:
        ch.unsub_handle = None
        if ch.watches or self._channels.get(ch.sid) is not ch:
            return  # someone came back during the delay
        self._drop_channel(ch)

    def _drop_channel(self, ch: _Channel) -> None:
        if ch.dead:
            return
        ch.dead = True
        if ch.unsub_handle is not None:
            ch.unsub_handle.cancel()
        if self._channels.get(ch.sid) is ch:
            del self._channels[ch.sid]
            self._by_bytes.pop(ch.name.encode(), None)
        if ch.resume.state.name != "CLOSED":
            ch.resume.close()
        if ch.fetch_task is not None and ch.fetch_task is not asyncio.current_task():
            ch.fetch_task.cancel()
        self._stats["unsubscribes"] += 1
        self._spawn(self.subscriber.unsubscribe([ch.name]))

    # -- live path (synchronous, called by the subscriber's reader tasks) -----------------

    def _on_message(self, channel: bytes, data: bytes) -> None:
        ch = self._by_bytes.get(channel)
        if ch is None:
            return
        self._stats["frames_in"] += 1
        d = _delivery(data, now_ms())
        if d is None:
            self._stats["bad_frames"] += 1
            return
        for observe in self.live_observers:
            observe(d)
        self._channel_step(ch, ch.resume.live(d))

    def _channel_step(self, ch: _Channel, step: Step) -> None:
        if step.emit:
            self._fanout(ch)(step.emit)
        if step.fetch is not None:
            self._stats["repairs"] += 1
            ch.fetch_task = self._spawn(
                self._fetch_loop(ch.sid, ch.resume, step.fetch, self._fanout(ch), ch.alive)
            )

    def _fanout(self, ch: _Channel) -> Sink:
        def sink(ds: list[Delivery]) -> None:
            if ds:
                ch.saw(ds)
            for w in list(ch.watches):
                w._live(ds)

        return sink

    def _on_resubscribed(self, channels: list[str]) -> None:
        for name in channels:
            ch = self._by_bytes.get(name.encode())
            if ch is not None and ch.ready.done():
                self._channel_step(ch, ch.resume.repair())

    # -- backlog reads -------------------------------------------------------------------

    async def _fetch_loop(
        self,
        sid: str,
        resume: Resume,
        fetch: Fetch | None,
        sink: Sink,
        alive: Callable[[], bool],
    ) -> None:
        """Answer ``resume``'s fetches until it needs none; retry on Redis errors."""
        backoff = 0.05
        while fetch is not None and alive():
            count = 0 if fetch.after is None else self.backlog_page
            try:
                frames, first, last = await read_backlog(self.redis, sid, fetch.after or 0, count)
            except RelayError as exc:
                log.info("backlog read for %s failed: %s", sid, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            if not alive():
                return
            if resume.started and resume.last is not None and last < resume.last:
                self._seal_later(sid, resume.last, resume.gen)  # a failover lost offsets
            entries = [d for d in map(_delivery, frames) if d is not None]
            step = resume.backlog(entries, first, last)
            sink(step.emit)
            fetch = step.fetch

    def _seal_later(self, sid: str, seen: int, gen: str = "") -> None:
        if sid in self._sealing:
            return
        self._sealing.add(sid)

        async def run() -> None:
            try:
                n = await seal(
                    self.redis,
                    sid,
                    seen,
                    sealer=self.relay_id,
                    maxlen=self.backlog_maxlen,
                    ttl_s=self.session_ttl_s,
                    gen=gen,
                )
                if n:
                    self._stats["sealed"] += n
                    log.warning("session %s: %d offset(s) up to %d lost", sid, n, seen)
            except RelayError as exc:
                log.info("seal of %s failed: %s", sid, exc)
            finally:
                self._sealing.discard(sid)

        self._spawn(run())

    # -- reaper ---------------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        """Every ``reap_interval_s``: each watched channel whose turn is open and silent
        for ``reap_after_s`` gets one :func:`relay.publisher.reap` (in a task of its own,
        at most one in flight per channel, then not before the next interval)."""
        while True:
            await asyncio.sleep(self.reap_interval_s)
            now = time.monotonic()
            for ch in list(self._channels.values()):
                if (
                    ch.watches
                    and ch.turn_open
                    and not ch.reaping
                    and ch.ready.done()
                    and now - ch.last_frame >= self.reap_after_s
                    and now >= ch.reap_next
                ):
                    ch.reaping = True
                    self._spawn(self._reap(ch))

    async def _reap(self, ch: _Channel) -> None:
        self._stats["reap_checks"] += 1
        try:
            res = await reap(
                self.redis,
                ch.sid,
                reaper=self.relay_id,
                maxlen=self.backlog_maxlen,
                ttl_s=self.session_ttl_s,
            )
        except RelayError as exc:
            self._stats["reap_errors"] += 1
            log.info("reap of %s failed: %s", ch.sid, exc)
        else:
            if res.status == "idle":
                ch.turn_open = False  # until the next token/meta frame
            elif res.status == "reaped":
                self._stats["reaped"] += 1
                log.warning("session %s: turn %d reaped (worker lost)", ch.sid, res.turn)
        finally:
            ch.reaping = False
            ch.reap_next = time.monotonic() + self.reap_interval_s

    # -- presence ------------------------------------------------------------------------

    async def _presence_loop(self) -> None:
        """Every ``presence_interval_s``: refresh every watched session. In between, a
        kick writes only what changed (sessions newly watched or left), so opening
        n watches costs O(n) writes, not a full refresh each (O(n^2))."""
        next_full = time.monotonic()
        while True:
            left = next_full - time.monotonic()
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._presence_kick.wait()
            self._presence_kick.clear()
            full = time.monotonic() >= next_full
            if full:
                next_full = time.monotonic() + self.presence_interval_s
            try:
                await self._presence_flush(full=full)
            except RelayError as exc:
                self._stats["presence_errors"] += 1
                log.info("presence refresh failed: %s", exc)

    async def _presence_flush(self, *, full: bool = True) -> None:
        """Write presence: every watched session (``full``) or only the new ones, and
        remove it for sessions no longer watched here. Pipelines of at most
        ``_PRESENCE_CHUNK`` sessions, yielding between them, so a large refresh never
        holds the event loop (and the frames waiting on it) for long."""
        if self._closed:
            watched: list[str] = []
        elif full:
            watched = [sid for sid, ch in self._channels.items() if ch.watches]
        else:
            watched = [
                s for s in self._presence_new if (ch := self._channels.get(s)) and ch.watches
            ]
        self._presence_new.clear()
        gone = [
            s
            for s in self._presence_gone
            if self._closed or not ((ch := self._channels.get(s)) and ch.watches)
        ]
        self._presence_gone.clear()
        now = now_ms()
        ttl_ms = int(self.presence_ttl_s * 1000)
        self._stats["presence_writes"] += len(watched)
        for i in range(0, max(len(watched), 1 if gone else 0), _PRESENCE_CHUNK):
            with map_redis_errors():
                async with self.redis.pipeline(transaction=False) as p:
                    for sid in watched[i : i + _PRESENCE_CHUNK]:
                        p.zadd(presence_key(sid), {self.relay_id: now})
                        p.pexpire(presence_key(sid), ttl_ms)
                    if i == 0:
                        for sid in gone:
                            p.zrem(presence_key(sid), self.relay_id)
                    await p.execute()
            await asyncio.sleep(0)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t
