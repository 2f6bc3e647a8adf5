"""A Durable Stream in the store: its names (every key under one hash tag, the id a hash
of its path) and its operations, each one atomic call of the store's
:class:`relay.broker.port.StreamStore` (on Redis: ``lua/write.lua``: append, producer
state, Stream-Seq, closure, expiry and the SPUBLISH that wakes live readers;
``lua/read.lua``: metadata and messages together, the sliding TTL reset).

Order of use::

    ref = StreamRef.of("chat/42")
    result = await write(streams, ref, Write(op="post", ...), messages)
    view = await read(streams, ref, start, count=1000)
"""

from __future__ import annotations

from typing import Final

from relay.broker.port import SoftDeleted, StreamStore
from relay.broker.port import StreamRef as _Ref
from relay.broker.port import StreamView as View
from relay.broker.port import StreamWrite as Write
from relay.broker.port import StreamWriteResult as WriteResult
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


class StreamRef(_Ref):
    """A stream's names: ``ds:{<stream_id(path)>}:meta|log|prod|forks|live``."""

    @classmethod
    def of(cls, path: str) -> StreamRef:
        return cls.tagged(path, stream_id(path))


async def write(streams: StreamStore, ref: _Ref, w: Write, messages: list[bytes]) -> WriteResult:
    return await streams.stream_write(ref, w, messages)


async def read(
    streams: StreamStore,
    ref: _Ref,
    start: int | None,
    *,
    count: int,
    touch: bool = True,
    max_bytes: int = 0,
) -> View | None:
    """The stream and up to ``count`` messages from ``start`` (None: the tail), at most
    ``max_bytes`` of them when > 0 (one message at least); None when there is no stream."""
    return await streams.stream_read(ref, start, count=count, touch=touch, max_bytes=max_bytes)


async def delete(streams: StreamStore, ref: _Ref) -> int:
    """Delete the stream: 404, 410 (already soft-deleted) or 204. A stream forks hold is
    soft-deleted; a fork removed releases its source, and a soft-deleted source released
    by its last fork goes too, up the chain."""
    code, src = await streams.stream_delete(ref)
    child = ref.path
    while code == 204 and src:
        parent = StreamRef.of(src)
        src = await streams.stream_fork_ref(parent, child, take=False)
        child = parent.path
    return code


async def fork_ref(streams: StreamStore, source: _Ref, fork_path: str) -> bool:
    """Record ``fork_path`` as a fork of ``source``; False when the source is gone."""
    return bool(await streams.stream_fork_ref(source, fork_path, take=True))
