"""A Durable Stream in Redis Cluster: every key of a stream under one hash tag
(``ds:{<id>}:meta|log|prod``, the id a hash of its path), each write one Lua call
(``lua/write.lua``: append, producer state, Stream-Seq, closure, expiry and the SPUBLISH
that wakes live readers), each read one Lua call (``lua/read.lua``: metadata and
messages together, the sliding TTL reset).

Order of use::

    ref = StreamRef.of("chat/42")
    result = await write(redis, ref, Write(op="post", ...), messages)
    view = await read(redis, ref, start, count=1000)
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from importlib import resources
from typing import Any, Final, Literal

from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.scripts import Script
from relay.durable.core import stream_id

__all__ = [
    "SoftDeleted",
    "StreamRef",
    "View",
    "Write",
    "WriteResult",
    "delete",
    "fork_ref",
    "read",
    "write",
]

CHANNEL_PREFIX: Final = b"ds:"


class _Script(Script):
    """A script of this package's ``lua/``, run like the broker's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


_WRITE: Final = _Script("write")
_READ: Final = _Script("read")
_DELETE: Final = _Script("delete")
_FORK_REF: Final = _Script("fork_ref")


class SoftDeleted(Exception):
    """The stream was deleted while forks hold it: 410 to every direct operation."""


@dataclass(frozen=True)
class StreamRef:
    path: str
    meta: str
    log: str
    prod: str
    forks: str
    channel: str

    @classmethod
    def of(cls, path: str) -> StreamRef:
        tag = f"ds:{{{stream_id(path)}}}"
        keys = (f"{tag}:{k}" for k in ("meta", "log", "prod", "forks", "live"))
        return cls(path, *keys)

    @property
    def keys(self) -> list[str]:
        return [self.meta, self.log, self.prod, self.forks]


@dataclass(frozen=True)
class Write:
    op: Literal["put", "post"]
    media_type: str
    content_type: str
    ttl: int | None = None
    expires_at: tuple[str, int] | None = None
    close: bool = False
    stream_seq: str | None = None
    producer: tuple[str, int, int] | None = None
    has_body: bool = False
    fork: str = ""  # a fork's identity: "source\noffset\nsub-offset"


@dataclass(frozen=True)
class WriteResult:
    code: int
    next: int
    closed: bool
    a: int  # producer epoch (200/204/403) or expected seq (409 gap)
    b: int  # producer seq (200/204) or received seq (409 gap)


@dataclass(frozen=True)
class View:
    """A stream's state and the messages read from ``start``."""

    media_type: str
    content_type: str
    ttl: int | None
    expires_at: str
    closed: bool
    next: int  # the tail
    gen: str
    low: int  # the earliest retained message
    start: int
    messages: list[bytes]

    @property
    def end(self) -> int:
        return self.start + len(self.messages)

    @property
    def json_mode(self) -> bool:
        return self.media_type == "application/json"


async def write(
    redis: RedisCluster, ref: StreamRef, w: Write, messages: list[bytes]
) -> WriteResult:
    pid, epoch, seq = w.producer if w.producer is not None else ("", 0, 0)
    args: list[Any] = [
        w.op, w.media_type, w.content_type,
        "" if w.ttl is None else str(w.ttl),
        "" if w.expires_at is None else w.expires_at[0],
        "" if w.expires_at is None else str(w.expires_at[1]),
        "1" if w.close else "0", w.stream_seq or "", pid, epoch, seq,
        secrets.token_hex(6), ref.channel, ref.path, "1" if w.has_body else "0", w.fork, *messages,
    ]  # fmt: skip
    reply = await _WRITE(redis, ref.keys, args)
    code, nxt, closed, a, b = (int(x) for x in reply)
    return WriteResult(code, nxt, bool(closed), a, b)


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


async def read(
    redis: RedisCluster,
    ref: StreamRef,
    start: int | None,
    *,
    count: int,
    touch: bool = True,
    max_bytes: int = 0,
) -> View | None:
    """The stream and up to ``count`` messages from ``start`` (None: the tail), at most
    ``max_bytes`` of them when > 0 (one message at least); None when there is no stream."""
    args = ["" if start is None else str(start), count, "1" if touch else "0", max_bytes]
    reply = await _READ(redis, ref.keys, args)
    if not reply:
        return None
    if reply[0] in (b"gone", "gone"):
        raise SoftDeleted(ref.path)
    mt, ct, ttl, ea, closed, n, gen, low, frm = (reply[i] for i in range(9))
    return View(
        media_type=_text(mt), content_type=_text(ct),
        ttl=int(ttl) if _text(ttl) else None, expires_at=_text(ea),
        closed=_text(closed) == "1", next=int(n), gen=_text(gen), low=int(low),
        start=int(frm), messages=[bytes(m) for m in reply[9:]],
    )  # fmt: skip


async def delete(redis: RedisCluster, ref: StreamRef) -> int:
    """Delete the stream: 404, 410 (already soft-deleted) or 204. A stream forks hold is
    soft-deleted; a fork removed releases its source, and a soft-deleted source released
    by its last fork goes too, up the chain."""
    reply = await _DELETE(redis, ref.keys, [ref.channel])
    code = int(reply[0])
    src = _text(reply[1]) if len(reply) > 1 else ""
    child = ref.path
    while code == 204 and src:
        parent = StreamRef.of(src)
        src = _text(await _FORK_REF(redis, parent.keys, ["-", child]))
        child = parent.path
    return code


async def fork_ref(redis: RedisCluster, source: StreamRef, fork_path: str) -> bool:
    """Record ``fork_path`` as a fork of ``source``; False when the source is gone."""
    return bool(await _FORK_REF(redis, source.keys, ["+", fork_path]))
