"""The producers' API: open a fenced generation, publish frames (backlog + live) in one
round trip, and read the backlog back.

Per session, everything sits in the session's hash slot (see :mod:`relay.keys`):

- ``meta_key(sid)`` hash: ``epoch`` (bumped by every generation), ``turn`` (bumped by
  every generation), ``offset`` (the last offset written);
- ``log_key(sid)`` stream: the backlog, one entry per frame with the explicit ID
  ``<offset>-1`` and one field ``f`` = the encoded frame, trimmed with ``MAXLEN ~``;
- ``live_channel(sid)`` shard channel: every frame is SPUBLISHed there too.

Retention: the backlog keeps at most about ``maxlen`` frames, and every key of the
session expires ``ttl_s`` seconds after the last write (each publish and each
``open_generation`` refreshes the TTL): the age cap *is* the idle TTL. When the keys
expire, offsets and epochs restart at 0 (a generation idle for ``ttl_s`` cannot be
fenced any more; it must not live that long).

Order of use::

    pub = Publisher(redis)
    gen = await pub.open_generation(sid)   # epoch+1, turn+1 (Lua, one slot)
    await gen.meta({...}); await gen.token("Hel"); await gen.publish([Draft(...), ...])
    await gen.done({...})                  # or gen.error("reason")
    frames, first, last = await read_backlog(redis, sid, after_offset, count)

``gen.publish`` runs one Lua script (EVALSHA, EVAL on NOSCRIPT): it checks the epoch
(a stale generation gets :class:`relay.errors.Fenced` and writes nothing) and the
expected offset, XADDs each frame, SPUBLISHes each frame (the channel is declared in
KEYS so the cluster slot check passes), bumps ``offset`` and refreshes the TTLs.
Each frame is encoded exactly once, in Python. redis-py errors become
:mod:`relay.errors` exceptions here.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import redis.exceptions as rex
from redis.asyncio.cluster import RedisCluster

from relay.errors import Fenced, OffsetConflict, RedisCommandError, map_redis_errors
from relay.frame import Frame, Kind, encode, now_ms
from relay.keys import live_channel, log_key, meta_key, parse_session

__all__ = [
    "Draft",
    "Generation",
    "Publisher",
    "read_backlog",
]

_OPEN_LUA: Final = """
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local turn = redis.call('HINCRBY', KEYS[1], 'turn', 1)
local off = tonumber(redis.call('HGET', KEYS[1], 'offset') or '0')
if off == 0 then
  local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if top[1] then
    off = tonumber(string.match(top[1][1], '^(%d+)'))
    redis.call('HSET', KEYS[1], 'offset', off)
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return {epoch, turn, off}
"""

_PUBLISH_LUA: Final = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'offset')
local epoch = tonumber(cur[1] or '0')
local off = tonumber(cur[2] or '0')
if epoch ~= tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. epoch) end
if off ~= tonumber(ARGV[2]) then return redis.error_reply('OFFSET ' .. off) end
for i = 5, #ARGV do
  off = off + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], string.format('%d-1', off), 'f', ARGV[i])
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
end
redis.call('HSET', KEYS[1], 'offset', off)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return off
"""

_READ_LUA: Final = """
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local last = tonumber(redis.call('HGET', KEYS[2], 'offset') or '0')
local firstoff = last + 1
if first[1] then firstoff = tonumber(string.match(first[1][1], '^(%d+)')) end
local out = {firstoff, last}
if tonumber(ARGV[2]) > 0 then
  local entries = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
  for _, e in ipairs(entries) do out[#out + 1] = e[2][2] end
end
return out
"""


class _Script:
    """A Lua script run with EVALSHA, falling back to EVAL once on NOSCRIPT."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, redis: RedisCluster, keys: Sequence[str], args: Sequence[Any]) -> Any:
        with map_redis_errors():
            try:
                return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
            except rex.NoScriptError:
                return await redis.execute_command("EVAL", self.source, len(keys), *keys, *args)


OPEN: Final = _Script(_OPEN_LUA)
PUBLISH: Final = _Script(_PUBLISH_LUA)
READ: Final = _Script(_READ_LUA)


class Draft(msgspec.Struct, frozen=True, kw_only=True):
    """What a producer says; the generation fills session, turn, offset, epoch and ts."""

    kind: Kind
    text: str = ""
    meta: dict[str, Any] | None = None


def _b(v: Any) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


@dataclass(slots=True)
class Generation:
    """One producer's right to append to a session, fenced by ``epoch``.

    ``offset`` is the last offset this generation wrote (or found); the next frame gets
    ``offset + 1``. Publishes of one generation are serialized.
    """

    publisher: Publisher
    session: str
    epoch: int
    turn: int
    offset: int
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)

    @property
    def next_offset(self) -> int:
        return self.offset + 1

    async def publish(self, drafts: Sequence[Draft]) -> list[int]:
        """Append and SPUBLISH ``drafts`` in one round trip; return their offsets.

        Raises :class:`Fenced` (a newer generation exists: nothing written) or
        :class:`OffsetConflict`; :class:`relay.errors.RedisUnavailable` if Redis is down
        (the batch may or may not have been written: a retry is safe, see below).
        """
        if not drafts:
            return []
        async with self._lock:
            pub = self.publisher
            base = self.offset
            ts = now_ms()
            payload = [
                encode(
                    Frame(
                        session=self.session,
                        turn=self.turn,
                        offset=base + i + 1,
                        kind=d.kind,
                        text=d.text,
                        epoch=self.epoch,
                        ts=ts,
                        meta=d.meta,
                    )
                )
                for i, d in enumerate(drafts)
            ]
            keys = (meta_key(self.session), log_key(self.session), live_channel(self.session))
            args: list[Any] = [self.epoch, base, pub.maxlen, pub.ttl_s, *payload]
            try:
                last = int(await PUBLISH(pub.redis, keys, args))
            except RedisCommandError as exc:
                msg = str(exc)
                if msg.startswith("FENCED "):
                    raise Fenced(self.session, self.epoch, int(msg.split()[1])) from None
                if msg.startswith("OFFSET "):
                    current = int(msg.split()[1])
                    if current != base + len(drafts):
                        raise OffsetConflict(self.session, base, current) from None
                    # redis-py retried a script whose reply was lost: our batch landed
                    # (no one else writes with our epoch).
                    last = current
                else:
                    raise
            self.offset = last
            return list(range(base + 1, last + 1))

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

    def __init__(self, redis: RedisCluster, *, maxlen: int = 10_000, ttl_s: int = 86_400) -> None:
        if maxlen < 1 or ttl_s < 1:
            raise ValueError("maxlen and ttl_s must be positive")
        self.redis = redis
        self.maxlen = maxlen
        self.ttl_s = ttl_s

    async def open_generation(self, sid: str) -> Generation:
        """Bump epoch and turn atomically; the returned generation fences all older ones."""
        sid = parse_session(sid)
        reply = await OPEN(self.redis, (meta_key(sid), log_key(sid)), (self.ttl_s,))
        epoch, turn, offset = (int(x) for x in reply)
        return Generation(self, sid, epoch, turn, offset)


async def read_backlog(
    redis: RedisCluster, sid: str, after_offset: int, count: int
) -> tuple[list[bytes], int, int]:
    """Up to ``count`` encoded frames with offsets > ``after_offset``, in order, plus the
    backlog's first available offset (``last + 1`` if empty) and the last offset written.

    One round trip (a read-only Lua script), so the three answers are consistent.
    ``count=0`` only reads the bounds.
    """
    sid = parse_session(sid)
    start = f"{max(after_offset, 0) + 1}-0"
    reply = await READ(redis, (log_key(sid), meta_key(sid)), (start, max(count, 0)))
    first, last = int(reply[0]), int(reply[1])
    return [_b(x) for x in reply[2:]], first, last
