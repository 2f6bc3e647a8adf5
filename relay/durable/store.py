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
    "prune",
    "read",
    "write",
]

CHANNEL_PREFIX: Final = b"ds:"
PRUNE_FORKS: Final = 100  # fork references checked per delete or blocked re-create


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
    soft-deleted (only while a fork still exists: :func:`prune`); a fork removed
    releases its source, and a soft-deleted source released by its last fork goes too,
    up the chain."""
    await prune(streams, ref)
    code, src = await streams.stream_delete(ref)
    if code == 204 and src:
        await _release(streams, src, ref.path)
    return code


async def _release(streams: StreamStore, src: str, child: str) -> None:
    """Release ``child``'s reference on ``src``, and so on up the chain while a release
    removes a soft-deleted source."""
    while src:
        parent = StreamRef.of(src)
        src = await streams.stream_fork_ref(parent, child, take=False)
        child = parent.path


async def prune(streams: StreamStore, ref: _Ref) -> bool:
    """Release the references of ``ref``'s forks that are gone without a delete (they
    expired: a TTL ends a stream without a word to its source), up to
    :data:`PRUNE_FORKS` of them: a soft-deleted stream whose forks all expired is then
    removed, and its path free. Whether any reference was released."""
    released = False
    for path in await streams.stream_forks(ref, PRUNE_FORKS):
        try:
            alive = await read(streams, StreamRef.of(path), None, count=0, touch=False)
        except SoftDeleted:
            continue  # a tombstone still holds what forked it
        if alive is None:
            await _release(streams, ref.path, path)
            released = True
    return released


async def fork_ref(streams: StreamStore, source: _Ref, fork_path: str) -> bool:
    """Record ``fork_path`` as a fork of ``source``; False when the source is gone."""
    return bool(await streams.stream_fork_ref(source, fork_path, take=True))
