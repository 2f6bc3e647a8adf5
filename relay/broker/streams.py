"""The Durable Streams part of the store port (:mod:`relay.broker.port` re-exports it): a
stream's names, a write and its answer, a read's view, the :class:`StreamStore` Protocol
both stores implement, and :class:`StreamsBroker`, an edge's broker that serves streams
too (their store and a tap on its live subscriptions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, Self, runtime_checkable

from relay.broker.base import Broker

__all__ = [
    "MESSAGE_OVERHEAD",
    "SoftDeleted",
    "StreamRef",
    "StreamStore",
    "StreamView",
    "StreamWrite",
    "StreamWriteResult",
    "StreamsBroker",
    "charge",
]

# What a stored message is charged beyond its bytes (a stream's byte bound, the byte
# budgets of relay.service.budget): about what the store spends per list element, so
# that a million 1-byte messages are not counted as 1 MB. lua/write.lua says it too.
MESSAGE_OVERHEAD = 16


def charge(messages: Sequence[bytes]) -> int:
    """The bytes ``messages`` are charged: their length + :data:`MESSAGE_OVERHEAD` each."""
    return sum(len(m) for m in messages) + MESSAGE_OVERHEAD * len(messages)


class SoftDeleted(Exception):
    """The stream was deleted while forks hold it: 410 to every direct operation."""


@dataclass(frozen=True)
class StreamRef:
    """A stream's names in the store, all under one hash tag (``tag`` from
    :func:`relay.durable.core.stream_id`)."""

    path: str
    meta: str
    log: str
    prod: str
    forks: str
    channel: str

    @classmethod
    def tagged(cls, path: str, tag: str) -> Self:
        prefix = f"ds:{{{tag}}}"
        keys = (f"{prefix}:{k}" for k in ("meta", "log", "prod", "forks", "live"))
        return cls(path, *keys)

    @property
    def keys(self) -> list[str]:
        return [self.meta, self.log, self.prod, self.forks]


@dataclass(frozen=True)
class StreamWrite:
    """One write of a stream (docs/DURABLE.md): create (``put``) or append (``post``); a
    create too large for one call (a fork's copy) is ``build`` steps, each appending to a
    stream nobody sees yet, then its ``put`` with the same ``build`` id (the commit)."""

    op: Literal["put", "post", "build"]
    media_type: str
    content_type: str
    ttl: int | None = None
    expires_at: tuple[str, int] | None = None
    close: bool = False
    stream_seq: str | None = None
    producer: tuple[str, int, int] | None = None
    has_body: bool = False
    fork: str = ""  # a fork's identity: "source\noffset\nsub-offset"
    build: str = ""  # a built create's id (its steps and its commit; its incarnation)
    max_bytes: int = 0  # the most the stream may hold (charge()); past it 413; 0: no bound


@dataclass(frozen=True)
class StreamWriteResult:
    code: int  # the HTTP status (413: the write would pass the stream's max_bytes)
    next: int
    closed: bool
    a: int  # producer epoch (200/204/403), expected seq (409 gap) or bytes held (413)
    b: int  # producer seq (200/204), received seq (409 gap) or the bound (413)


@dataclass(frozen=True)
class StreamView:
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
    # the position after each message, where they are not consecutive (a chat session's
    # frames: a gap frame stands at the last offset it covers); None: start + 1, + 2, ...
    positions: list[int] | None = None

    @property
    def end(self) -> int:
        return self.after(len(self.messages))

    def after(self, count: int) -> int:
        """The position after the first ``count`` messages."""
        if self.positions is not None and count:
            return self.positions[count - 1]
        return self.start + count

    @property
    def json_mode(self) -> bool:
        return self.media_type == "application/json"


@runtime_checkable
class StreamStore(Protocol):
    """Durable Streams: each operation atomic on the stream."""

    async def stream_write(
        self, ref: StreamRef, w: StreamWrite, messages: Sequence[bytes]
    ) -> StreamWriteResult:
        """Create, append or close, atomically whatever the number of ``messages``; the
        live readers are woken (the stream's channel). A ``build`` step answers 202 (409
        when the stream exists or another build holds it) and leaves a stream that reads
        as absent for a few seconds past its last step; its commit (``put`` with its id)
        answers 201, or 412 when the build is not there (expired). A write (a build step
        or its commit included) that would make the stream hold more than ``w.max_bytes``
        (> 0) bytes, counted by :func:`charge` (its messages since its creation), is 413
        and stores nothing."""
        ...

    async def stream_read(
        self, ref: StreamRef, start: int | None, *, count: int, touch: bool = True,
        max_bytes: int = 0,
    ) -> StreamView | None:  # fmt: skip
        """The stream and up to ``count`` messages from ``start`` (None: the tail), at
        most ``max_bytes`` of them when > 0 (one at least); None when there is none;
        :class:`SoftDeleted` when forks hold a deleted one. ``touch``: a sliding TTL
        starts again."""
        ...

    async def stream_delete(self, ref: StreamRef) -> tuple[int, str]:
        """404, 410 (soft-deleted already) or 204 and the source path a removed fork
        releases ("" for none; forks still holding it: soft-deleted)."""
        ...

    async def stream_forks(self, ref: StreamRef, limit: int) -> list[str]:
        """Up to ``limit`` of the paths of the forks that hold ``ref`` (any of them)."""
        ...

    async def stream_fork_ref(self, source: StreamRef, fork_path: str, take: bool) -> str:
        """Take (``take``: "1" when taken, "" when the source is gone or soft-deleted) or
        release a fork's reference on ``source`` (the source's own source path when this
        release removed a soft-deleted source, else "")."""
        ...

    async def take_bytes(self, key: str, n: int, limit: int, window_ms: int) -> int:
        """Count ``n`` bytes in ``key``'s sliding window of ``window_ms`` (by the store's
        clock, in steps of a sixtieth of it) unless that passes ``limit``: 0 when counted,
        -1 when ``n`` alone passes it, else the milliseconds until enough leaves the window
        (at least 1000). ``n`` < 0 gives back bytes counted earlier (never refused)."""
        ...


@runtime_checkable
class StreamsBroker(Broker, Protocol):
    """An edge's broker that serves Durable Streams too: the streams' store, and a second
    reader of its live subscriptions (the tap: a stream's channel held while a live
    read waits on it, whoever else holds it)."""

    @property
    def streams(self) -> StreamStore: ...

    async def tap_subscribe(self, channel: str) -> None: ...

    def tap_unsubscribe(self, channel: str) -> None: ...
