"""The per-relay fan-out that the edge server uses: one subscription per session,
any number of local watchers, each resumed from its own offset, each with a bounded queue.

Pieces: :class:`relay.broker.rediscluster.subscriber.ShardedSubscriber` (one pubsub connection
per node) hands the ``smessage``s of each read chunk to :meth:`Hub._on_message` (synchronous: the
reader never awaits a consumer; the chunk's sockets are written right after it). Per
channel, a :class:`relay.edge.core.resume.Resume` keeps channel-level order (duplicates
dropped; a hole -> one backlog read for all watchers); per watcher, a
:class:`relay.edge.fanout.tap.Tap` drives a pure :class:`relay.edge.core.watch.Watch` (replay merged
with the live feed, bounded queue, conflation, slow-consumer cutoff) and writes to its
socket straight from the reader while the socket has room. Replays are read page by page as
the socket drains, under a relay-wide byte budget (:class:`relay.edge.fanout.tap.ByteBudget`).

Beside the hub, fed by its set of watched sessions:
:class:`relay.broker.rediscluster.presence.Presence` (written when a session's first local
watcher opens, removed when its last one leaves, refreshed with a long TTL) and
:class:`relay.edge.fanout.reaper.Reaper` (ends turns whose worker died).

Background work runs on one :class:`relay.service.supervise.Supervisor` (the relay's, or
one the hub makes for itself): the subscriber's sync loop, the presence refresh, the
reaper, and every task the hub starts (subscribes, backlog reads, seals), whose failures
are logged rather than lost.

Reference counts without races (centrifuge ``node.go``): the first watcher of a session
subscribes (all other watchers await the same future; a failure rolls back); the last
one leaving schedules an unsubscribe after ``unsubscribe_delay_s`` that re-checks the
count.

Order of use::

    hub = Hub(redis, relay_id="edge-1"); await hub.start()
    tap = await hub.watch(sid, from_offset, gen)  # None: live only; 0: whole backlog; n: after n
    while True: deliveries = await tap.next() # raises WatchClosed(reason, code)
    await tap.close(); await hub.close()      # (a server uses tap.run(out) instead of next)

With ``Hub(..., supervisor=s)``, stop ``s`` before ``hub.close()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError, WatchClosed
from relay.broker.rediscluster.presence import Presence
from relay.broker.rediscluster.publisher import seal
from relay.broker.rediscluster.subscriber import ShardedSubscriber
from relay.edge.core.resume import Delivery, Fetch, Resume, ResumeState, Step
from relay.edge.core.watch import Limits, Watch, conflate
from relay.edge.fanout.reaper import Reaper, ReapState
from relay.edge.fanout.tap import ByteBudget, Flusher, Tap, delivery, read_page
from relay.protocol.codes import CloseCode
from relay.protocol.frame import monotonic_ms
from relay.protocol.keys import live_channel, parse_session
from relay.service.supervise import QUICK_BACKOFF, Supervisor

__all__ = ["Delivery", "Hub", "Tap", "Watch", "WatchClosed", "conflate"]

log = logging.getLogger(__name__)


def _outcome_seen(f: asyncio.Future[None]) -> None:
    """Mark a future's exception as retrieved (no "never retrieved" log)."""
    if not f.cancelled():
        f.exception()


class _Channel(ReapState):
    """Hub state of one subscribed session channel (and what the reaper reads of it)."""

    __slots__ = ("_many", "_one", "dead", "fetch_task", "name", "ready", "resume", "unsub_handle")

    def __init__(self, sid: str) -> None:
        super().__init__(sid)
        self.name = live_channel(sid)
        # its taps: most sessions have one watcher on a relay, held without a set
        self._one: Tap | None = None
        self._many: set[Tap] | None = None  # two or more
        self.resume = Resume(sid, None)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready.add_done_callback(_outcome_seen)
        self.dead = False
        self.unsub_handle: asyncio.TimerHandle | None = None
        self.fetch_task: asyncio.Task[None] | None = None

    def alive(self) -> bool:
        return not self.dead

    def add(self, tap: Tap) -> None:
        if self._many is not None:
            self._many.add(tap)
        elif self._one is None:
            self._one = tap
        elif self._one is not tap:
            self._many, self._one = {self._one, tap}, None

    def discard(self, tap: Tap) -> bool:
        """Remove ``tap``; False if it was not there."""
        if self._one is tap:
            self._one = None
            return True
        many = self._many
        if many is None or tap not in many:
            return False
        many.discard(tap)
        if len(many) == 1:
            self._one, self._many = many.pop(), None
        return True

    @property
    def watched(self) -> int:
        """How many taps."""
        return len(self._many) if self._many is not None else int(self._one is not None)

    def taps(self) -> list[Tap]:
        if self._many is not None:
            return list(self._many)
        return [] if self._one is None else [self._one]

    def feed(self, ds: list[Delivery]) -> None:
        """Live frames to every tap, in channel order."""
        if self._one is not None:
            self._one.feed(ds)
        elif self._many is not None:
            for t in list(self._many):
                t.feed(ds)


class Hub:
    """Fan-out of session channels to local watchers. See the module docstring.

    Bounds: ``queue_frames`` / ``hard_limit_frames`` / ``max_pending_bytes`` per watcher
    (conflation, then ``slow_consumer``); ``backlog_page`` frames and ``page_bytes`` bytes
    per backlog read; ``replay_budget_bytes`` of replay pages in memory relay-wide (past
    it new replays wait their turn). Presence entries live ``presence_ttl_s``."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        queue_frames: int = 1024,
        hard_limit_frames: int = 4096,
        max_pending_bytes: int = 1 << 20,
        unsubscribe_delay_s: float = 2.0,
        relay_id: str,
        read_from_replicas: bool = False,
        backlog_page: int = 512,
        page_bytes: int = 256 * 1024,
        replay_budget_bytes: int = 64 << 20,
        presence_ttl_s: float = 30.0,
        reap_after_s: float = 2.0,
        reap_interval_s: float = 1.0,
        backlog_maxlen: int = 10_000,
        session_ttl_s: int = 86_400,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.redis = redis
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
        self.relay_id = relay_id
        self.backlog_page = backlog_page
        self.backlog_maxlen = backlog_maxlen
        self.session_ttl_s = session_ttl_s
        self.budget = ByteBudget(replay_budget_bytes)
        self.flusher = Flusher()  # one write per socket per read chunk
        self.subscriber = ShardedSubscriber(
            redis,
            on_message=self._on_message,
            on_resubscribed=self._on_resubscribed,
            relay_id=relay_id,
            read_from_replicas=read_from_replicas,
            supervisor=self.supervisor,
        )
        self.presence = Presence(redis, relay_id, ttl_s=presence_ttl_s)
        self.reaper = Reaper(
            redis,
            relay_id,
            self._reapable,
            reap_after_s=reap_after_s,
            interval_s=reap_interval_s,
            maxlen=backlog_maxlen,
            ttl_s=session_ttl_s,
        )
        self._channels: dict[str, _Channel] = {}
        self._by_bytes: dict[bytes, _Channel] = {}
        self._sealing: set[str] = set()
        self._closed = False
        # called with the live frames of each read chunk (servers time publish -> edge
        # here, once per frame, not once per socket)
        self.live_observers: list[Callable[[list[Delivery]], None]] = []
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "watches_opened",
                "frames_in",
                "reads",
                "frames_out",
                "bad_frames",
                "conflations",
                "slow_disconnects",
                "replays",
                "gaps",
                "repairs",
                "subscribes",
                "unsubscribes",
                "sealed",
                "writes_direct",
                "writes_queued",
            ),
            0,
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.subscriber.start()
        self.presence.start(self.supervisor)
        self.reaper.start(self.supervisor)

    async def close(self) -> None:
        """Tell every watcher the relay shuts down, stop the background work (a
        supervisor given to the constructor must be stopped before), remove this relay's
        presence entries, close the subscriber's connections."""
        if self._closed:
            return
        self._closed = True
        for ch in list(self._channels.values()):
            for tap in ch.taps():
                tap.shut("the relay is shutting down", CloseCode.RELAY_SHUTDOWN)
        for ch in list(self._channels.values()):
            self._drop_channel(ch)
        if self._owns_supervisor:
            await self.supervisor.stop()
        await self.presence.close()
        await self.subscriber.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out.update(self.presence.stats)
        out.update(self.reaper.stats)
        out["watches"] = sum(ch.watched for ch in self._channels.values())
        out["channels"] = len(self._channels)
        out["channels_per_node"] = self.subscriber.channels_per_node()
        out["resubscribes"] = self.subscriber.stats["resubscribes"]
        out["subscriber"] = dict(self.subscriber.stats)
        out["replay_budget_used"] = self.budget.used
        out["replay_budget_peak"] = self.budget.peak
        out["replay_budget_waits"] = self.budget.waits
        return out

    # -- watchers ----------------------------------------------------------------------

    async def watch(self, sid: str, from_offset: int | None, gen: str | None = None) -> Tap:
        """Subscribe (shared), then replay after ``from_offset`` (page by page, as the
        consumer takes frames) and follow live. Live only (``None``): returns once the
        backlog's bounds are read. ``gen``: the generation ``from_offset`` belongs to, if
        the client said: another generation than the session's gets a ``reset`` and a
        replay from offset 1 (:mod:`relay.edge.core.resume`).

        Raises :class:`relay.broker.errors.SubscribeError` if the channel cannot be subscribed
        (after the subscriber's timeout). Backlog reads are retried while Redis is
        unreachable: wrap the call in ``asyncio.timeout`` to bound the wait.
        """
        if self._closed:
            raise WatchClosed("the relay is shutting down", CloseCode.RELAY_SHUTDOWN)
        sid = parse_session(sid)
        if from_offset is not None and from_offset < 0:
            raise ValueError("from_offset must be >= 0 or None")
        ch = self._channels.get(sid)
        if ch is None:
            ch = self._open_channel(sid)
        if ch.unsub_handle is not None:
            ch.unsub_handle.cancel()
            ch.unsub_handle = None
        watch = Watch(sid, from_offset, self.limits, self._stats, gen or "")
        tap = Tap(sid, watch, self)
        ch.add(tap)  # counted (and fed live frames) before any await
        self._stats["watches_opened"] += 1
        try:
            await asyncio.shield(ch.ready)
            if from_offset is not None:
                self._stats["replays"] += 1
            tap.subscribed()
            if from_offset is None:
                await tap.first_read()
        except BaseException:
            tap.shut("watch setup failed", CloseCode.CLOSED)
            raise
        if not tap.closed:
            self.presence.add(sid)  # a no-op unless this is the session's first watcher
        return tap

    def _open_channel(self, sid: str) -> _Channel:
        ch = _Channel(sid)
        self._channels[sid] = ch
        self._by_bytes[ch.name.encode()] = ch
        self._spawn(f"subscribe:{sid}", self._subscribe_channel(ch))
        return ch

    async def _subscribe_channel(self, ch: _Channel) -> None:
        try:
            await self.subscriber.subscribe([ch.name])
            self._stats["subscribes"] += 1
            step = ch.resume.subscribed()  # channel level: start at the current end
            await self._fetch_loop(ch, step.fetch)
        except BaseException as exc:  # roll back; every waiting watcher gets the error
            self._drop_channel(ch)
            if not ch.ready.done():
                ch.ready.set_exception(exc if isinstance(exc, Exception) else RelayError("closed"))
            if not isinstance(exc, Exception):
                raise
            return
        if not ch.ready.done():
            ch.ready.set_result(None)

    def offsets_lost(self, sid: str, seen: int) -> None:
        """A tap's backlog read ends before ``seen`` (delivered): seal the lost range."""
        self._seal_later(sid, seen)

    def tap_closed(self, tap: Tap) -> None:
        ch = self._channels.get(tap.session)
        if ch is None or not ch.discard(tap):
            return
        if ch.watched or ch.dead or self._closed:
            return
        self.presence.remove(ch.sid)
        loop = asyncio.get_running_loop()
        ch.unsub_handle = loop.call_later(self.unsubscribe_delay_s, self._maybe_unsubscribe, ch)

    def _maybe_unsubscribe(self, ch: _Channel) -> None:
        ch.unsub_handle = None
        if ch.watched or self._channels.get(ch.sid) is not ch:
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
        if ch.resume.state is not ResumeState.CLOSED:
            ch.resume.close()
        if ch.fetch_task is not None and ch.fetch_task is not asyncio.current_task():
            ch.fetch_task.cancel()
        self._stats["unsubscribes"] += 1
        if not self._closed:  # on close, the subscriber's connections close anyway
            self._spawn(f"unsubscribe:{ch.sid}", self.subscriber.unsubscribe([ch.name]))

    def _reapable(self) -> Iterator[_Channel]:
        return (ch for ch in self._channels.values() if ch.watched and ch.ready.done())

    # -- live path (synchronous, called from the subscriber's node connections) ----------

    def _on_message(self, msgs: list[list[bytes]]) -> None:
        """The ``smessage`` replies of one read chunk, in order: per frame a decode, the
        channel's resume (duplicates, holes) and its taps; per chunk the clocks, the
        counters and the observers."""
        stats, flusher = self._stats, self.flusher
        received, now = monotonic_ms(), time.monotonic()  # (now: for the reaper)
        seen: list[Delivery] = []
        flusher.hold()  # one write per socket for the whole chunk, right after it
        try:
            self._on_chunk(msgs, received, now, seen)
        finally:
            flusher.release()
        stats["frames_in"] += len(seen)
        stats["reads"] += 1
        if seen:
            for observe in self.live_observers:
                observe(seen)

    def _on_chunk(
        self, msgs: list[list[bytes]], received: int, now: float, seen: list[Delivery]
    ) -> None:
        by_bytes, stats = self._by_bytes, self._stats
        for msg in msgs:
            ch = by_bytes.get(msg[1])
            if ch is None:
                continue
            d = delivery(msg[2], received)
            if d is None:
                stats["bad_frames"] += 1
                continue
            seen.append(d)
            try:
                resume = ch.resume
                if resume.next_live(d):  # the common case, without Step and list building
                    ch.saw_one(d, now)
                    ch.feed([d])
                else:
                    self._channel_step(ch, resume.live(d), now)
            except Exception:  # one channel's bug must not cost the chunk's other frames
                log.exception("live frame of %s failed", ch.sid)

    def _channel_step(self, ch: _Channel, step: Step, now: float) -> None:
        if step.emit:
            self._fanout(ch, step.emit, now)
        if step.fetch is not None:
            self._stats["repairs"] += 1
            ch.fetch_task = self._spawn(f"repair:{ch.sid}", self._fetch_loop(ch, step.fetch))

    def _fanout(self, ch: _Channel, ds: list[Delivery], now: float) -> None:
        ch.saw(ds, now)
        ch.feed(ds)

    def _on_resubscribed(self, channels: list[str]) -> None:
        for name in channels:
            ch = self._by_bytes.get(name.encode())
            if ch is not None and ch.ready.done():
                self._channel_step(ch, ch.resume.repair(), time.monotonic())

    # -- backlog reads of a channel (holes and repairs, shared by all its watchers) ------

    async def _fetch_loop(self, ch: _Channel, fetch: Fetch | None) -> None:
        """Answer the channel resume's fetches until it needs none."""
        resume = ch.resume
        while fetch is not None and ch.alive():
            page = await read_page(self.redis, ch.sid, fetch.after, self.backlog_page, 0, ch.alive)
            if page is None:
                return
            frames, first, last, gen = page
            if resume.started and resume.last is not None and last < resume.last:
                self._seal_later(ch.sid, resume.last, resume.gen)  # a failover lost offsets
            entries = [d for d in map(delivery, frames) if d is not None]
            step = resume.backlog(entries, first, last, gen)
            if step.emit:
                self._fanout(ch, step.emit, time.monotonic())
            fetch = step.fetch

    def _seal_later(self, sid: str, seen: int, gen: str = "") -> None:
        if sid in self._sealing:
            return
        self._sealing.add(sid)

        async def run() -> None:  # a failure is logged by the supervisor
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
            finally:
                self._sealing.discard(sid)

        self._spawn(f"seal:{sid}", run())

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[Any]:
        """A task of the hub: logged if it fails, cancelled when the supervisor stops."""
        return self.supervisor.spawn(name, coro)
