"""Following the engines' KV-cache events: ZeroMQ subscriptions around the block index.

What it is for: the ``precise`` routing policy reads :class:`worker.routing.blockindex.
BlockIndex`; this shell keeps it current. Per engine that publishes events (vLLM
``--kv-events-config``, SGLang, ``python -m devstack engine --kv-events-port``) one task:

1. a SUB socket on the engine's publisher (every topic) and a DEALER on its replay socket;
2. on connect, a replay from sequence 0 (what the engine's buffer still holds: its cache
   as it was before this worker came);
3. each message ``[topic, seq, payload]``: the index says apply, duplicate or gap; a gap
   asks the replay socket for the missing batches (waiting at most ``replay_timeout_s``);
   unanswered, or answered from later than the gap (the engine's buffer moved on), the
   engine's blocks are dropped and it counts for nothing until it has been followed again
   for ``resync_s`` (the router estimates it meanwhile);
4. a message that is not a batch (garbled, truncated, an unknown event tag, a bad frame)
   is lost information too: the same drop, the reason counted and logged once per engine
   and reason; more than ``max_events_per_s`` events in a second (a flood; the default
   200,000 is below what one worker absorbs, ``bench.routing.precise``, and far above
   what an engine's steps store and evict) drops the engine until the second is over,
   its batches counted, not applied.

Where an engine announces its events: the worker's ``--engine-kv-events
ID=tcp://HOST:PUB[,tcp://HOST:REPLAY]`` (the replay port defaults to the PUB port + 1, as
vLLM's defaults 5557/5558), one per engine id, beside its ``--engine``. An engine the
router removes is dropped from the index (:meth:`KVEventFollower.set_sources`).

Nothing here runs on the routing path: the router's :meth:`BlockIndex.match` reads memory.
The counters (:attr:`KVEventFollower.counts`) become ``tokenrelay_worker_kv_events_*``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

from worker.routing.blockindex import BlockIndex
from worker.routing.kvwire import END_SEQ, KVWireError, decode_batch, decode_seq, encode_seq

if TYPE_CHECKING:  # pyzmq is the precise extra: imported when a follower starts
    import zmq.asyncio

__all__ = ["EventSource", "KVEventFollower", "parse_kv_events_arg"]

log = logging.getLogger(__name__)

_COUNTS: Final = (
    "messages",  # live messages handled
    "batches_applied",
    "events_applied",
    "duplicates",
    "gaps",
    "replays",  # replay requests sent
    "replayed",  # batches received by replay
    "replay_unanswered",  # a replay that timed out or came back short
    "flood_dropped",  # batches dropped over the rate limit
)


@dataclass(frozen=True, slots=True)
class EventSource:
    engine: str
    endpoint: str  # the PUB socket
    replay: str  # the ROUTER socket ("" : none)


def parse_kv_events_arg(arg: str) -> EventSource:
    """``ID=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` -> EventSource; ValueError (one
    line) otherwise."""
    eid, sep, rest = arg.partition("=")
    if not sep or not eid:
        raise ValueError(f"--engine-kv-events wants ID=tcp://HOST:PORT, got {arg!r}")
    pub, _, replay = rest.partition(",")
    port = _tcp_port(pub, arg)
    if replay:
        _tcp_port(replay, arg)
    else:
        replay = f"{pub.rsplit(':', 1)[0]}:{port + 1}"
    return EventSource(eid, pub, replay)


def _tcp_port(endpoint: str, arg: str) -> int:
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        raise ValueError(f"--engine-kv-events wants tcp://HOST:PORT endpoints, got {arg!r}")
    return port


class KVEventFollower:
    """One subscription task per engine; ``await start()``, ``await stop()``."""

    def __init__(
        self,
        index: BlockIndex,
        sources: Iterable[EventSource] = (),
        *,
        replay_timeout_s: float = 1.0,
        resync_s: float = 10.0,
        max_events_per_s: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self.resync_s = resync_s
        self.max_events_per_s = max_events_per_s
        self._clock = clock
        self._sources = {s.engine: s for s in sources}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self.counts: dict[str, int] = dict.fromkeys(_COUNTS, 0)
        self.bad: dict[str, int] = {}  # messages that were not a batch, by reason
        self._logged: set[tuple[str, str]] = set()
        self._window: dict[str, tuple[float, int]] = {}  # engine -> (second, events)

    def sources(self) -> list[EventSource]:
        return list(self._sources.values())

    async def start(self) -> None:
        import zmq.asyncio  # the precise extra (WorkerConfig refuses the flag without it)

        self._ctx = zmq.asyncio.Context()
        for src in self._sources.values():
            self._spawn(src)

    def set_sources(self, sources: Iterable[EventSource]) -> None:
        """Follow these engines; those no longer named are dropped from the index."""
        new = {s.engine: s for s in sources}
        for name in list(self._sources):
            if new.get(name) != self._sources[name]:
                self._drop(name)
        for name, src in new.items():
            if name not in self._sources:
                self._sources[name] = src
                if self._ctx is not None:
                    self._spawn(src)

    def engine_down(self, name: str) -> None:
        """The control plane lost the engine: forget its blocks (it may come back
        restarted, its cache empty); the subscription stays (ZeroMQ reconnects)."""
        self.index.reset_engine(name)

    def _drop(self, name: str) -> None:
        self._sources.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self.index.remove_engine(name)

    def tick(self) -> None:
        """Periodic (the worker's control loop): engines whose resync is over count again."""
        self.index.tick(self._clock())

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _spawn(self, src: EventSource) -> None:
        self.index.add_engine(src.engine)
        self._tasks[src.engine] = asyncio.create_task(
            self._follow(src), name=f"kv-events-{src.engine}"
        )

    # ---- one engine ---------------------------------------------------------------------

    async def _follow(self, src: EventSource) -> None:
        import zmq

        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(src.endpoint)
        replay: zmq.asyncio.Socket | None = None
        try:
            if src.replay:
                replay = self._dealer(src)
                replay = await self._replay(src, replay, 0)
            while True:
                frames = await sub.recv_multipart()
                replay = await self._message(src, frames, replay)
                self.counts["messages"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or a dead context: the engine falls back
            self._bad(src.engine, "internal", repr(exc))
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _dealer(self, src: EventSource) -> zmq.asyncio.Socket:
        import zmq

        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(src.replay)
        return sock

    async def _message(
        self, src: EventSource, frames: list[bytes], replay: zmq.asyncio.Socket | None
    ) -> zmq.asyncio.Socket | None:
        name, index = src.engine, self.index
        if len(frames) != 3:
            self._lost(name, "frames", f"{len(frames)} frames, want 3")
            return replay
        try:
            seq = decode_seq(frames[1])
        except KVWireError as exc:
            self._lost(name, exc.kind, str(exc))
            return replay
        verdict = index.sequence(name, seq)
        if verdict == "gap":
            self.counts["gaps"] += 1
            want = index.expected(name)
            if replay is not None and want is not None:
                replay = await self._replay(src, replay, want)
            if (index.expected(name) or 0) < seq:  # still missing: unfilled
                self.counts["replay_unanswered"] += 1
                index.unfilled(name, self._clock(), self.resync_s)
            verdict = index.sequence(name, seq)
        if verdict == "duplicate":
            self.counts["duplicates"] += 1
            return replay
        self._apply(name, frames[2])
        return replay

    def _apply(self, name: str, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVWireError as exc:
            self._lost(name, exc.kind, str(exc))
            return
        now = self._clock()
        second, n = self._window.get(name, (-1.0, 0))
        if int(now) != second:
            second, n = int(now), 0
        n += len(batch.events)
        self._window[name] = (second, n)
        if n > self.max_events_per_s:
            self.counts["flood_dropped"] += 1
            if n - len(batch.events) <= self.max_events_per_s:  # the first batch past it
                self._lost(name, "flood", f"over {self.max_events_per_s} events/s")
            else:
                self.index.unfilled(name, now, self.resync_s)
            return
        self.index.apply(name, batch, now)
        self.counts["batches_applied"] += 1
        self.counts["events_applied"] += len(batch.events)

    async def _replay(
        self, src: EventSource, sock: zmq.asyncio.Socket, start: int
    ) -> zmq.asyncio.Socket:
        """Ask for every batch from ``start`` on and apply them; returns the socket to use
        next (a fresh one after a timeout, so a late answer cannot mix with the next)."""
        self.counts["replays"] += 1
        await sock.send_multipart((b"", encode_seq(start)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        while True:
            left = deadline - loop.time()
            if left <= 0 or not await sock.poll(int(left * 1000) + 1):
                sock.close(linger=0)
                return self._dealer(src)
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                self._lost(src.engine, "frames", f"replay of {len(frames)} frames")
                continue
            try:
                seq = decode_seq(frames[1])
            except KVWireError as exc:
                self._lost(src.engine, exc.kind, str(exc))
                continue
            if seq == END_SEQ:
                self.index.synced(src.engine, self._clock())
                return sock
            self.counts["replayed"] += 1
            if self.index.sequence(src.engine, seq) == "apply":
                self._apply(src.engine, frames[2])

    def _lost(self, name: str, reason: str, detail: str) -> None:
        """A message whose events are lost: the engine's view is dropped until resync."""
        self._bad(name, reason, detail)
        self.index.unfilled(name, self._clock(), self.resync_s)

    def _bad(self, name: str, reason: str, detail: str) -> None:
        self.bad[reason] = self.bad.get(reason, 0) + 1
        if (name, reason) not in self._logged:
            self._logged.add((name, reason))
            log.warning(
                "kv events from %s: %s (%s); its blocks are dropped, the router estimates it "
                "for %.0f s (logged once per engine and reason)",
                name,
                reason,
                detail[:200],
                self.resync_s,
            )
