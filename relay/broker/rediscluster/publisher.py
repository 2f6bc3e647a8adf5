"""The producers' API: open a fenced generation, publish frames (backlog + live) in one
round trip, and read the backlog back.

Per session, everything sits in the session's hash slot (see :mod:`relay.protocol.keys`):

- ``meta_key(sid)`` hash: ``gen`` (the session's generation id: random, set when the
  hash is created, so a session whose keys expired and restarted has a new one; every
  frame carries it as ``meta.gen``), ``epoch`` (bumped by every generation and by a reap),
  ``turn`` (bumped by every generation), ``offset`` (the last offset written), ``open``
  (the turn that is generating: set by ``open_generation``, cleared by a ``done`` or
  ``error`` frame and by :func:`reap`), ``ttl`` (the session's lifetime in seconds, as
  its producer applies it: relays extend a watched session's keys by it, see
  :mod:`relay.broker.rediscluster.presence`);
- ``log_key(sid)`` stream: the backlog, one entry per frame with the explicit ID
  ``<offset>-1``, the field ``f`` = the encoded frame and ``b`` = where it starts in the
  session's byte count (the hash's ``bytes`` is where the next one starts), trimmed with
  ``MAXLEN ~`` to about ``maxlen`` frames and with ``MINID`` to ``max_bytes`` bytes;
- ``live_channel(sid)`` shard channel: every frame is SPUBLISHed there too.

Retention: the backlog keeps at most about ``maxlen`` frames and ``max_bytes`` bytes of
frames (the oldest go first, whole; the newest always stays), and every key of the
session expires ``ttl_s`` seconds after the last write (each publish and each
``open_generation`` refreshes the TTL; a reap or a seal keeps the TTL the session has)
or after the last presence refresh of a relay that has viewers of it: the age cap *is*
the idle TTL. When the keys expire, offsets and epochs restart at 0
under a new ``gen``: a producer of the old generation is fenced by it, and a relay
that sees frames of a new ``gen`` tells its clients with a ``reset`` frame
(:mod:`relay.edge.core.resume`).

Order of use::

    pub = Publisher(redis)
    gen = await pub.open_generation(sid)   # epoch+1, turn+1 (Lua, one slot)
    await gen.meta({...}); await gen.token("Hel"); await gen.publish([Draft(...), ...])
    await gen.done({...})                  # or gen.error("reason")
    frames, first, last = await read_backlog(redis, sid, after_offset, count)
    await reap(redis, sid, reaper="edge-1")  # relays: end a turn whose worker died

``gen.publish`` runs one Lua script (EVALSHA, EVAL on NOSCRIPT): it checks the epoch
(a stale generation gets :class:`relay.broker.errors.Fenced` and writes nothing) and the
expected offset, XADDs each frame, SPUBLISHes each frame (the channel is declared in
KEYS so the cluster slot check passes), bumps ``offset`` and refreshes the TTLs.
Each frame is encoded exactly once, in Python. redis-py errors become
:mod:`relay.broker.rediscluster.errors` exceptions here.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.base import BacklogPage, ReapResult, ReapStatus
from relay.broker.errors import (
    Fenced,
    OffsetConflict,
    RedisCommandError,
    RedisUnavailable,
    SessionDeleted,
)
from relay.broker.port import Draft, encode_drafts
from relay.broker.rediscluster.scripts import OPEN, PUBLISH, READ, REAP, SEAL
from relay.protocol.frame import now_ms
from relay.protocol.keys import (
    BACKLOG_MAX_BYTES,
    BACKLOG_MAXLEN,
    SESSION_TTL_S,
    KeyKind,
    gone_key,
    key,
    live_channel,
    log_key,
    meta_key,
    parse_session,
)

__all__ = [
    "WORKER_LOST",
    "Draft",
    "Generation",
    "Publisher",
    "read_backlog",
    "read_backlog_page",
    "reap",
    "seal",
]

WORKER_LOST: Final = "worker lost"


def _b(v: Any) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


@dataclass(slots=True)
class Generation:
    """One producer's right to append to a session, fenced by ``epoch``.

    ``offset`` is the last offset this generation wrote (or found); the next frame gets
    ``offset + 1``. Publishes of one generation are serialized. The generation keeps
    the encoded frames it wrote (at most ``publisher.keep_frames``) so that it can write
    them again when a failover lost them (see :meth:`publish`).
    """

    publisher: Publisher
    session: str
    epoch: int
    turn: int
    offset: int
    gen: str = ""  # the session's generation id, in every frame's meta
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    _written: dict[int, bytes] = field(default_factory=dict, repr=False, compare=False)
    rewritten: int = 0  # frames written again after a failover lost them
    retries: int = 0  # publish attempts repeated while Redis was unreachable
    # Called with (offset, kind, encoded frame) for every frame once Redis took it, in
    # offset order: a producer that also streams the frames itself (the worker's
    # closed loop) sends exactly the bytes that relays send. Must not block or raise.
    observers: list[Callable[[int, str, bytes], None]] = field(
        default_factory=list, repr=False, compare=False
    )

    @property
    def next_offset(self) -> int:
        return self.offset + 1

    async def publish(self, drafts: Sequence[Draft]) -> list[int]:
        """Append and SPUBLISH ``drafts`` in one round trip; return their offsets.

        Raises :class:`Fenced` (a newer generation exists: nothing written),
        :class:`FrameTooLarge` (a frame over ``MAX_FRAME_BYTES``: nothing written) or
        :class:`OffsetConflict`; :class:`relay.broker.errors.RedisUnavailable` if Redis stays
        unreachable for ``publisher.retry_s`` (the batch may or may not have been
        written).

        Retries are safe: the script checks the epoch and the expected offset, so a
        batch that landed before its reply was lost is recognised (``OFFSET`` equal to
        our end) and never written twice. After a failover whose new master lacks our
        last frames (asynchronous replication: ``OFFSET`` below ours), the frames this
        generation wrote are written again, same bytes at the same offsets, before the
        new batch: readers dedupe by offset, and the backlog has no hole.
        """
        if not drafts:
            return []
        async with self._lock:
            pub = self.publisher
            base = self.offset
            ts = now_ms()
            payload = encode_drafts(
                drafts, session=self.session, turn=self.turn, epoch=self.epoch, gen=self.gen,
                base=base, ts=ts,
            )  # fmt: skip
            terminal = drafts[-1].kind in ("done", "error")
            last = await self._write(base, payload, terminal)
            for i, data in enumerate(payload):
                self._written[base + i + 1] = data
            while len(self._written) > pub.keep_frames:
                del self._written[next(iter(self._written))]
            self.offset = last
            for obs in self.observers:
                for i, data in enumerate(payload):
                    obs(base + i + 1, drafts[i].kind, data)
            return list(range(base + 1, last + 1))

    def script_call(
        self, base: int, payload: Sequence[bytes], terminal: bool = False
    ) -> tuple[tuple[str, str, str], list[Any]]:
        """The publish script's KEYS and ARGV for ``payload`` after offset ``base`` (its
        layout: ``lua/publish.lua``); for code that sends the call itself (benchmarks)."""
        pub = self.publisher
        keys = (meta_key(self.session), log_key(self.session), live_channel(self.session))
        args: list[Any] = [
            self.epoch, base, pub.maxlen, pub.ttl_s, int(terminal), self.turn, self.gen,
            pub.max_bytes, now_ms(), *payload,
        ]  # fmt: skip
        return keys, args

    async def _write(self, base: int, payload: list[bytes], terminal: bool) -> int:
        """Run the publish script until it answers (retrying while Redis is away)."""
        pub = self.publisher
        keys, args = self.script_call(base, payload, terminal)
        deadline = time.monotonic() + pub.retry_s
        backoff = 0.05
        while True:
            try:
                return int(await PUBLISH(pub.redis, keys, args))
            except RedisUnavailable:
                if time.monotonic() + backoff > deadline:
                    raise
                self.retries += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            except RedisCommandError as exc:
                msg = str(exc)
                if msg.startswith("FENCED "):
                    raise Fenced(self.session, self.epoch, int(msg.split()[1])) from None
                if not msg.startswith("OFFSET "):
                    raise
                current = int(msg.split()[1])
            if current == base + len(payload):
                # a retry of a script whose reply was lost: our batch landed (no one
                # else writes with our epoch)
                return current
            lost = range(current + 1, base + 1)
            if current < base and all(o in self._written for o in lost):
                # the new master lacks frames we wrote: write them again, same bytes
                self.rewritten += len(lost)
                await self._write(current, [self._written[o] for o in lost], False)
                continue
            raise OffsetConflict(self.session, base, current)

    async def token(self, text: str) -> int:
        return (await self.publish([Draft(kind="token", text=text)]))[0]

    async def meta(self, meta: Mapping[str, Any]) -> int:
        return (await self.publish([Draft(kind="meta", meta=dict(meta))]))[0]

    async def done(self, meta: Mapping[str, Any] | None = None) -> int:
        return (await self.publish([Draft(kind="done", meta=dict(meta) if meta else None)]))[0]

    async def error(self, reason: str) -> int:
        return (await self.publish([Draft(kind="error", text=reason)]))[0]


class Publisher:
    """Opens generations on sessions. One per process; safe to share between tasks."""

    def __init__(
        self,
        redis: RedisCluster,
        *,
        maxlen: int = BACKLOG_MAXLEN,
        ttl_s: int = SESSION_TTL_S,
        retry_s: float = 10.0,
        keep_frames: int = 4096,
        max_bytes: int = BACKLOG_MAX_BYTES,
    ) -> None:
        if maxlen < 1 or ttl_s < 1 or keep_frames < 1 or retry_s < 0 or max_bytes < 0:
            raise ValueError("maxlen, ttl_s and keep_frames must be positive")
        self.redis = redis
        self.maxlen = maxlen
        self.max_bytes = max_bytes  # bytes of frames the backlog keeps (0: no byte bound)
        self.ttl_s = ttl_s
        self.retry_s = retry_s  # how long a publish retries while Redis is unreachable
        self.keep_frames = keep_frames  # frames a generation keeps to rewrite after failover

    async def open_generation(self, sid: str) -> Generation:
        """Bump epoch and turn atomically; the returned generation fences all older ones.
        A turn the session still has open (its producer died or lost its lock) is ended
        first, in the same script: its ``error`` frame (``superseded``) at the next
        offset, which the generation keeps among the frames it wrote (written again
        should a failover lose it)."""
        sid = parse_session(sid)
        fresh = secrets.token_hex(6)  # the session's gen if this call creates it
        keys = (meta_key(sid), log_key(sid), live_channel(sid))
        args = (self.ttl_s, fresh, sid, now_ms(), self.maxlen, self.max_bytes)
        reply = await OPEN(self.redis, keys, args)
        epoch, turn, offset = (int(x) for x in reply[:3])
        g = Generation(self, sid, epoch, turn, offset, _b(reply[3]).decode())
        if len(reply) > 4:  # the frame that ended the open turn
            g._written[offset] = _b(reply[4])
        return g


async def reap(
    redis: RedisCluster,
    sid: str,
    *,
    reaper: str,
    maxlen: int = BACKLOG_MAXLEN,
    ttl_s: int = SESSION_TTL_S,
    reason: str = WORKER_LOST,
    max_bytes: int = BACKLOG_MAX_BYTES,
) -> ReapResult:
    """End a session's open turn whose worker is gone (its turn lock expired).

    One Lua script on the session's slot, so any number of relays may race: while the
    lock ``key(sid, LOCK)`` exists nothing happens; otherwise, if a turn is open, the
    epoch is bumped (the dead producer, should it wake up, gets :class:`Fenced`), an
    ``error`` frame (``text`` = ``reason``, ``meta.code`` = ``"worker_lost"``) is appended
    and SPUBLISHed at the next offset, and the turn is marked closed: exactly once.
    """
    sid = parse_session(sid)
    keys = (meta_key(sid), log_key(sid), live_channel(sid), key(sid, KeyKind.LOCK))
    reply = await REAP(redis, keys, (maxlen, ttl_s, sid, now_ms(), reason, reaper, max_bytes))
    status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    return ReapResult(ReapStatus(status), int(reply[1]), int(reply[2]))


async def seal(
    redis: RedisCluster,
    sid: str,
    seen: int,
    *,
    sealer: str,
    maxlen: int = BACKLOG_MAXLEN,
    ttl_s: int = SESSION_TTL_S,
    gen: str = "",
    max_bytes: int = BACKLOG_MAX_BYTES,
) -> int:
    """A relay delivered offsets up to ``seen`` but the session now ends before them: a
    failover promoted a replica that never got them (asynchronous replication) and no
    producer wrote them again. Write one ``gap`` frame at ``seen`` (``meta.from`` ..
    ``meta.to`` = the lost range, ``code`` "lost_in_failover") so that no offset a
    client already holds is ever reused for another frame, and readers that lack the
    range are told. Returns how many offsets were sealed (0: nothing was missing).
    ``gen``: the generation the relay delivered ``seen`` in; when the session now has
    another one (its keys expired and restarted) or none, nothing is sealed (a seal
    would write an old offset into a new generation, or bring an expired session back).
    """
    sid = parse_session(sid)
    keys = (meta_key(sid), log_key(sid), live_channel(sid))
    args = (seen, maxlen, ttl_s, sid, now_ms(), sealer, gen, max_bytes)
    return int(await SEAL(redis, keys, args))


async def read_backlog_page(
    redis: RedisCluster, sid: str, after_offset: int, count: int, max_bytes: int = 0
) -> BacklogPage:
    """Up to ``count`` encoded frames with offsets > ``after_offset``, in order, plus the
    backlog's first available offset (``last + 1`` if empty), the last offset written
    and the session's generation.

    One round trip (a read-only Lua script), so the answers are consistent.
    ``count=0`` only reads the bounds. ``max_bytes`` > 0: stop before the frame that
    would take the reply past that many bytes (the first frame always comes back).
    Raises :class:`relay.broker.errors.SessionDeleted` when the session was deleted (its
    tombstone exists): the same script checks it, so a relay learns it without a trip more.
    """
    sid = parse_session(sid)
    args = (f"{max(after_offset, 0) + 1}-0", max(count, 0), max(max_bytes, 0))
    try:
        r = await READ(redis, (log_key(sid), meta_key(sid), gone_key(sid)), args)
    except RedisCommandError as exc:
        if str(exc).startswith("GONE"):
            raise SessionDeleted(sid) from None
        raise
    return BacklogPage([_b(x) for x in r[3:]], int(r[0]), int(r[1]), _b(r[2]).decode())


async def read_backlog(
    redis: RedisCluster, sid: str, after_offset: int, count: int, max_bytes: int = 0
) -> tuple[list[bytes], int, int]:
    """:func:`read_backlog_page` without the generation: (frames, first, last)."""
    return (await read_backlog_page(redis, sid, after_offset, count, max_bytes))[:3]
