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
    "SoftDeleted",
    "StreamRef",
    "StreamStore",
    "StreamView",
    "StreamWrite",
    "StreamWriteResult",
    "StreamsBroker",
]


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


@dataclass(frozen=True)
class StreamWriteResult:
    code: int  # the HTTP status
    next: int
    closed: bool
    a: int  # producer epoch (200/204/403) or expected seq (409 gap)
    b: int  # producer seq (200/204) or received seq (409 gap)


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

    @property
    def end(self) -> int:
        return self.start + len(self.messages)

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
        answers 201, or 412 when the build is not there (expired)."""
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


@runtime_checkable
class StreamsBroker(Broker, Protocol):
    """An edge's broker that serves Durable Streams too: the streams' store, and a second
    reader of its live subscriptions (the tap: a stream's channel held while a live
    read waits on it, whoever else holds it)."""

    @property
    def streams(self) -> StreamStore: ...

    async def tap_subscribe(self, channel: str) -> None: ...

    def tap_unsubscribe(self, channel: str) -> None: ...
