"""A :class:`relay.broker.base.Broker` in this process's memory: the edge's rules without
a server.

What the Redis broker's scripts do, in Python, with the same answers: a backlog per
session (offsets 1, 2, 3, ..., trimmed from the front past ``maxlen`` frames or
``max_bytes`` bytes, the newest frame always kept), its generation
id, the open turn, the turn lock, presence, and live delivery to subscribers. The
fan-out tests (tests/integration/test_fanout.py) and ``bench.relay.micro`` run the real
hub and connections on it; nothing here is on a production path.

A live frame reaches the hub's handler from the event loop (``call_soon``), one read
per :meth:`MemoryBroker.append` call, as a shard connection's chunk would: never from
inside the producer's call.

What a test can do to it besides producing (:meth:`MemoryBroker.append`,
:meth:`MemoryBroker.append_raw`, :meth:`MemoryBroker.open_turn`):

- :meth:`MemoryBroker.lose` the next live frames of a session (a lost Pub/Sub message:
  the hub sees a hole and repairs from the backlog);
- :meth:`MemoryBroker.trim` a session's backlog (a resume past it gets a ``gap``);
- :meth:`MemoryBroker.resubscribed` (what a slot move or failover makes the Redis
  subscriber report);
- :meth:`MemoryBroker.restart` a session (its keys expired: a new generation);
- :meth:`MemoryBroker.peer` another relay's screen count of a session (and
  :meth:`MemoryBroker.expire` its presence: its count stops counting);
- :meth:`MemoryBroker.delete` a session (what the worker's delete does: its keys gone,
  a tombstone, the deleted notice on its channel);
- :meth:`MemoryBroker.fail` the next calls (an unreachable store).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.broker.base import (
    BacklogPage,
    MessageHandler,
    ReapResult,
    ReapStatus,
    ResubscribedHandler,
)
from relay.broker.errors import RedisUnavailable, RelayError, SessionDeleted, SubscribeError
from relay.protocol.frame import Frame, Kind, decode, deleted_frame, encode, now_ms
from relay.protocol.keys import BACKLOG_MAX_BYTES, BACKLOG_MAXLEN, live_channel, parse_session
from relay.service.supervise import Supervisor

__all__ = ["MemoryBroker"]


@dataclass
class _Session:
    gen: str
    log: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, frame), in order
    offset: int = 0  # the last offset written
    epoch: int = 0  # bumped by every generation and by a reap (a stale one is fenced)
    turn: int = 0
    open: int = 0  # the turn that is generating (0: none)
    locked: bool = False  # a producer holds the turn lock
    lose: int = 0  # live frames still to drop
    held: int = 0  # bytes of the frames in log


class MemoryBroker:
    """See the module docstring."""

    def __init__(
        self,
        relay_id: str = "memory",
        *,
        maxlen: int = BACKLOG_MAXLEN,
        max_bytes: int = BACKLOG_MAX_BYTES,
    ) -> None:
        self.relay_id = relay_id
        self.maxlen = maxlen
        self.max_bytes = max_bytes  # 0: no byte bound
        self.sessions: dict[str, _Session] = {}
        self.subscribed: set[str] = set()
        self.presence: set[str] = set()
        self.tombstones: set[str] = set()  # deleted sessions (their tombstones)
        # sid -> relay -> screens: this relay's field and the peers' a test gave it;
        # a peer's counts while it is in live_peers (its presence entry has not expired)
        self.screen_counts: dict[str, dict[str, int]] = {}
        self.live_peers: dict[str, set[str]] = {}
        self.screen_writes = 0  # sessions written
        self.screen_calls = 0  # calls of screens(): batches
        self.reads = 0
        self._on_message: MessageHandler | None = None
        self._on_resubscribed: ResubscribedHandler | None = None
        self._failing = 0
        self._closed = False
        self._wrote = asyncio.Event()  # set (and replaced) by a backlog write ...
        self._waiting = 0  # ... while frames_after waits

    # -- the Broker interface ------------------------------------------------------------

    def channel(self, sid: str) -> bytes:
        return live_channel(sid).encode()

    def bind(
        self, on_message: MessageHandler, on_resubscribed: ResubscribedHandler,
        on_recount: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """``on_recount`` is never called: one process, no relay taken for dead."""
        self._on_message, self._on_resubscribed = on_message, on_resubscribed

    async def start(self, supervisor: Supervisor) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        self.presence.clear()
        self.subscribed.clear()

    async def subscribe(self, sid: str) -> None:
        if self._closed:
            raise SubscribeError("broker closed")
        self._check()
        self.subscribed.add(sid)

    def unsubscribe(self, sid: str) -> None:
        self.subscribed.discard(sid)

    async def read_page(
        self, sid: str, after: int | None, count: int, max_bytes: int
    ) -> BacklogPage:
        self._check()
        self.reads += 1
        self._exists(sid)
        s = self.sessions.get(parse_session(sid))
        if s is None:
            return BacklogPage([], 1, 0, "")
        first = s.log[0][0] if s.log else s.offset + 1
        frames: list[bytes] = []
        if after is not None and count > 0:
            size = 0
            for off, data in s.log:
                if off <= after:
                    continue
                if len(frames) >= count or (
                    max_bytes > 0 and frames and size + len(data) > max_bytes
                ):
                    break
                frames.append(data)
                size += len(data)
        return BacklogPage(frames, first, s.offset, s.gen)

    async def seal(self, sid: str, seen: int, gen: str) -> int:
        self._check()
        s = self.sessions.get(sid)
        if s is None or s.offset >= seen or (gen and s.gen != gen):
            return 0
        lost = seen - s.offset
        meta = {"from": s.offset + 1, "to": seen, "code": "lost_in_failover",
                "sealed_by": self.relay_id, "gen": s.gen}  # fmt: skip
        frame = Frame(session=sid, turn=0, offset=seen, kind="gap",
                      text="frames lost in a Redis failover", ts=now_ms(), meta=meta)  # fmt: skip
        self._write(s, sid, seen, encode(frame))
        return lost

    async def reap(self, sid: str) -> ReapResult:
        self._check()
        s = self.sessions.get(sid)
        if s is not None and s.locked:  # the script's order: the lock first, then the turn
            return ReapResult(ReapStatus.LOCKED, 0, 0)
        if s is None or not s.open:
            return ReapResult(ReapStatus.IDLE, 0, 0)
        turn, off = s.open, s.offset + 1
        meta = {"code": "worker_lost", "reaped_by": self.relay_id, "gen": s.gen}
        frame = Frame(session=sid, turn=turn, offset=off, kind="error", text="worker lost",
                      ts=now_ms(), meta=meta)  # fmt: skip
        self._write(s, sid, off, encode(frame))
        s.open = 0
        return ReapResult(ReapStatus.REAPED, off, turn)

    def present(self, sid: str) -> None:
        self.presence.add(sid)

    def absent(self, sid: str) -> None:
        self.presence.discard(sid)

    async def screens(self, counts: Sequence[tuple[str, int]]) -> list[int | RelayError]:
        self._check()
        self.screen_calls += 1
        out: list[int | RelayError] = []
        for sid, count in counts:
            try:
                self._exists(sid)
            except SessionDeleted as exc:
                out.append(exc)
                continue
            self.screen_writes += 1
            fields = self.screen_counts.setdefault(sid, {})
            if count > 0:
                fields[self.relay_id] = count
            else:
                fields.pop(self.relay_id, None)
            out.append(self._total(sid))
        return out

    async def active_turn(self, sid: str) -> tuple[int, int] | None:
        self._check()
        self._exists(sid)
        s = self.sessions.get(sid)
        if s is None or not s.open:
            return None
        before = s.offset
        for off, data in reversed(s.log):
            if decode(data).turn != s.open:  # an older turn, or a gap: stop there
                return s.open, off
            before = off - 1
        return s.open, max(before, 0)

    async def ping(self) -> None:
        self._check()

    def stats(self) -> Mapping[str, Any]:
        return {"channels_per_node": {"memory": len(self.subscribed)}, "resubscribes": 0,
                "subscriber": {}, "presence_writes": 0, "presence_errors": 0}  # fmt: skip

    # -- producing ---------------------------------------------------------------------

    def open_turn(self, sid: str, *, locked: bool = True) -> int:
        """A new turn of ``sid`` is generating (with its producer's lock held)."""
        s = self._session(sid)
        s.turn += 1
        s.open, s.locked = s.turn, locked
        return s.turn

    def unlock(self, sid: str) -> None:
        """The producer's turn lock expired (it died): the turn may be reaped."""
        self._session(sid).locked = False

    def append(
        self, sid: str, kind: Kind = "token", text: str = "", *, meta: dict[str, Any] | None = None,
        turn: int | None = None,
    ) -> int:  # fmt: skip
        """One frame of ``sid`` at the next offset, into the backlog and to subscribers."""
        s = self._session(sid)
        off = s.offset + 1
        frame = Frame(session=sid, turn=s.turn if turn is None else turn, offset=off,
                      kind=kind, text=text, epoch=1, ts=now_ms(),
                      meta={**(meta or {}), "gen": s.gen})  # fmt: skip
        self._write(s, sid, off, encode(frame))
        if kind in ("done", "error"):
            s.open = 0
        return off

    def append_raw(self, sid: str, offset: int, data: bytes) -> None:
        """Encoded frame bytes at ``offset`` (a test's own frame, as a producer wrote it)."""
        self._write(self._session(sid), sid, offset, data)

    # -- faults ------------------------------------------------------------------------

    def lose(self, sid: str, n: int = 1) -> None:
        """The next ``n`` live frames of ``sid`` reach the backlog but no subscriber."""
        self._session(sid).lose += n

    def trim(self, sid: str, first: int) -> None:
        """The backlog of ``sid`` keeps only offsets >= ``first``."""
        s = self._session(sid)
        s.log = [(o, d) for o, d in s.log if o >= first]
        s.held = sum(len(d) for _, d in s.log)

    def restart(self, sid: str) -> str:
        """The session's keys expired: everything gone, a new generation from offset 1."""
        self.sessions[sid] = s = _Session(gen=secrets.token_hex(6))
        return s.gen

    def delete(self, sid: str) -> None:
        """What a producer's delete does: every key of ``sid`` gone, its tombstone
        written, :func:`relay.protocol.frame.deleted_frame` sent to its subscribers (not
        to a backlog: there is none any more)."""
        self.sessions.pop(parse_session(sid), None)
        self.screen_counts.pop(sid, None)
        self.live_peers.pop(sid, None)
        self.tombstones.add(sid)
        self._send(sid, encode(deleted_frame(sid)))

    def peer(self, sid: str, relay: str, count: int) -> None:
        """Another relay serves ``sid`` to ``count`` screens (its presence is live); the
        total is sent only with the next count written (as on Redis)."""
        self.screen_counts.setdefault(sid, {})[relay] = count
        self.live_peers.setdefault(sid, set()).add(relay)

    def expire(self, sid: str, relay: str) -> None:
        """``relay``'s presence entry of ``sid`` expired (it died): what the presence
        refresh script does then, its field dropped and the new total sent."""
        self.live_peers.get(sid, set()).discard(relay)
        if self.screen_counts.get(sid, {}).pop(relay, None) is not None:
            self._total(sid)

    def resubscribed(self, sids: list[str]) -> None:
        """Tell the hub its live feed of ``sids`` may have lost frames."""
        assert self._on_resubscribed is not None
        self._on_resubscribed(sids)

    def fail(self, n: int) -> None:
        """The next ``n`` calls raise RedisUnavailable (an unreachable store)."""
        self._failing = n

    # -- internals ---------------------------------------------------------------------

    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(parse_session(sid))
        if s is None:
            s = self.sessions[sid] = _Session(gen=secrets.token_hex(6))
        return s

    def _total(self, sid: str) -> int:
        """The session's screens over the relays whose presence is live (other fields
        dropped), sent as a presence frame."""
        fields = self.screen_counts.get(sid, {})
        live = self.live_peers.get(sid, set())
        for relay in [r for r in fields if r != self.relay_id and r not in live]:
            del fields[relay]
        total = sum(fields.values())
        frame = Frame(session=sid, turn=0, offset=0, kind="presence", ts=now_ms(),
                      meta={"screens": total})  # fmt: skip
        self._send(sid, encode(frame))
        return total

    def _exists(self, sid: str) -> None:
        """What the scripts check first: a deleted session answers nothing."""
        if sid in self.tombstones:
            raise SessionDeleted(sid)

    def _check(self) -> None:
        if self._failing > 0:
            self._failing -= 1
            raise RedisUnavailable("memory broker: failing on purpose")

    async def frames_after(
        self, sid: str, after: int, count: int, *, block_ms: int = 0
    ) -> list[bytes]:
        """The port's :meth:`relay.broker.port.HistoryStore.frames_after`: a wait ends at
        the next backlog write (of any session: read again) or after ``block_ms``."""
        self._check()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000
        while True:
            s = self.sessions.get(sid)
            out = [] if s is None else [d for o, d in s.log if o > after][:count]
            left = deadline - loop.time()
            if out or left <= 0:
                return out
            self._waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wrote.wait(), left)
            finally:
                self._waiting -= 1

    def _write(self, s: _Session, sid: str, offset: int, data: bytes) -> None:
        if self._waiting:  # the readers waiting in frames_after read again
            self._wrote.set()
            self._wrote = asyncio.Event()
        s.log.append((offset, data))
        s.held += len(data)
        s.offset = max(s.offset, offset)
        drop = max(len(s.log) - self.maxlen, 0)
        s.held -= sum(len(d) for _, d in s.log[:drop])
        while self.max_bytes and s.held > self.max_bytes and drop < len(s.log) - 1:
            s.held -= len(s.log[drop][1])
            drop += 1
        if drop:
            del s.log[:drop]
        if s.lose > 0 and sid in self.subscribed and self._on_message is not None:
            s.lose -= 1
            return
        self._send(sid, data)

    def _send(self, sid: str, data: bytes) -> None:
        """``data`` to the subscribers of ``sid`` (SPUBLISH), from the event loop."""
        if sid not in self.subscribed or self._on_message is None:
            return
        msg = [b"smessage", self.channel(sid), data]
        asyncio.get_running_loop().call_soon(self._deliver, msg)

    def _deliver(self, msg: list[bytes]) -> None:
        if self._on_message is not None and not self._closed:
            self._on_message([msg])
