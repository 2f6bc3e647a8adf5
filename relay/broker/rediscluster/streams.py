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
            w.fork, w.build, b"".join(b"%d:%b" % (len(m), m) for m in messages),
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

    async def stream_forks(self, ref: StreamRef, limit: int) -> list[str]:
        with map_redis_errors():
            members = await self.redis.srandmember(ref.forks, limit)
        return [_text(m) for m in members or []]

    async def stream_fork_ref(self, source: StreamRef, fork_path: str, take: bool) -> str:
        reply = await _FORK_REF(self.redis, source.keys, ["+" if take else "-", fork_path])
        if take:
            return "1" if int(reply) else ""
        return _text(reply)
