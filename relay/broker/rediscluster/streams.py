"""Durable Streams on a Redis Cluster (the :class:`relay.broker.port.StreamStore` part of
:class:`relay.broker.rediscluster.store.RedisStore`): every key of a stream under one hash
tag (``ds:{<id>}:meta|log|prod|forks``), each write one Lua call (``write.lua``: append,
producer state, Stream-Seq, closure, expiry and the SPUBLISH that wakes live readers),
each read one Lua call (``read.lua``: metadata and messages together, the sliding TTL
reset). The scripts are the files of ``relay/durable/lua/``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster

from relay.broker.port import (
    SoftDeleted,
    StreamRef,
    StreamView,
    StreamWrite,
    StreamWriteResult,
)
from relay.broker.rediscluster.errors import map_redis_errors
from relay.broker.rediscluster.scripts import Script

__all__ = ["RedisStreams"]


class _Script(Script):
    """A script of ``relay/durable/lua/``, run like the broker's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files("relay.durable").joinpath("lua", f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


_WRITE: Final = _Script("write")
_READ: Final = _Script("read")
_DELETE: Final = _Script("delete")
_FORK_REF: Final = _Script("fork_ref")

# A sliding window of bytes (relay.broker.streams.StreamStore.take_bytes): a hash of
# step -> bytes counted in it, at most ~61 fields (the window in sixtieths), so a call
# reads a bounded hash whatever the traffic. KEYS[1]; ARGV: n, limit, window ms.
# Returns 0 (counted), -1 (n alone passes the limit) or the ms until it would fit.
_TAKE_BYTES: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, limit, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local step = math.max(math.floor(window / 60), 1000)
local cur, first = math.floor(now / step), math.floor((now - window) / step) + 1
local all = redis.call('HGETALL', KEYS[1])
local used, live = 0, {}
for i = 1, #all, 2 do
  local b, v = tonumber(all[i]), tonumber(all[i + 1])
  if b < first then
    redis.call('HDEL', KEYS[1], all[i])
  else
    used = used + v
    live[#live + 1] = {b, v}
  end
end
if n > 0 and used + n > limit then
  if n > limit then return -1 end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  local over = used + n - limit
  for _, e in ipairs(live) do
    over = over - e[2]
    if over <= 0 then return math.max(e[1] * step + window - now, 1000) end
  end
  return window
end
redis.call('HINCRBY', KEYS[1], cur, n)
redis.call('PEXPIRE', KEYS[1], window)
return 0
"""


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class RedisStreams:
    """The Durable Streams' operations on ``redis``."""

    def __init__(self, redis: RedisCluster) -> None:
        self.redis = redis

    async def stream_write(
        self, ref: StreamRef, w: StreamWrite, messages: Sequence[bytes]
    ) -> StreamWriteResult:
        pid, epoch, seq = w.producer if w.producer is not None else ("", 0, 0)
        args: list[Any] = [
            w.op, w.media_type, w.content_type,
            "" if w.ttl is None else str(w.ttl),
            "" if w.expires_at is None else w.expires_at[0],
            "" if w.expires_at is None else str(w.expires_at[1]),
            "1" if w.close else "0", w.stream_seq or "", pid, epoch, seq,
            w.build or secrets.token_hex(6), ref.channel, ref.path, "1" if w.has_body else "0",
            w.fork, w.build, max(w.max_bytes, 0),
            b"".join(b"%d:%b" % (len(m), m) for m in messages),
        ]  # fmt: skip
        reply = await _WRITE(self.redis, ref.keys, args)
        code, nxt, closed, a, b = (int(x) for x in reply)
        return StreamWriteResult(code, nxt, bool(closed), a, b)

    async def stream_read(
        self, ref: StreamRef, start: int | None, *, count: int, touch: bool = True,
        max_bytes: int = 0,
    ) -> StreamView | None:  # fmt: skip
        args = ["" if start is None else str(start), count, "1" if touch else "0", max_bytes]
        reply = await _READ(self.redis, ref.keys, args)
        if not reply:
            return None
        if reply[0] in (b"gone", "gone"):
            raise SoftDeleted(ref.path)
        mt, ct, ttl, ea, closed, n, gen, low, frm = (reply[i] for i in range(9))
        return StreamView(
            media_type=_text(mt), content_type=_text(ct),
            ttl=int(ttl) if _text(ttl) else None, expires_at=_text(ea),
            closed=_text(closed) == "1", next=int(n), gen=_text(gen), low=int(low),
            start=int(frm), messages=[bytes(m) for m in reply[9:]],
        )  # fmt: skip

    async def stream_delete(self, ref: StreamRef) -> tuple[int, str]:
        reply = await _DELETE(self.redis, ref.keys, [ref.channel])
        return int(reply[0]), _text(reply[1]) if len(reply) > 1 else ""

    async def take_bytes(self, key: str, n: int, limit: int, window_ms: int) -> int:
        with map_redis_errors():
            got = await self.redis.eval(_TAKE_BYTES, 1, key, n, limit, window_ms)
        return int(got)

    async def stream_forks(self, ref: StreamRef, limit: int) -> list[str]:
        with map_redis_errors():
            members = await self.redis.srandmember(ref.forks, limit)
        return [_text(m) for m in members or []]

    async def stream_fork_ref(self, source: StreamRef, fork_path: str, take: bool) -> str:
        reply = await _FORK_REF(self.redis, source.keys, ["+" if take else "-", fork_path])
        if take:
            return "1" if int(reply) else ""
        return _text(reply)
