"""Durable Streams in this process's memory (the :class:`relay.broker.port.StreamStore`
part of :class:`relay.broker.memstore.MemoryStore`): the rules of
``relay/durable/lua/{write,read,delete,fork_ref}.lua`` in Python, with the same answers.
A write wakes the stream's live readers as the script's SPUBLISH does (the tap's
channels, :meth:`MemoryStreams.tap_subscribe`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from relay.broker.base import MessageHandler
from relay.broker.port import (
    SoftDeleted,
    StreamRef,
    StreamView,
    StreamWrite,
    StreamWriteResult,
    charge,
)

__all__ = ["MemoryStreams"]

BUILD_S = 10.0  # a build's stream lives this long past its last step (write.lua's BUILD_MS)


@dataclass
class _Stream:
    mt: str
    ct: str
    ttl: str
    ea: str
    eams: str
    fork: str
    gen: str
    closed: bool = False
    deleted: bool = False
    building: str = ""  # a built create's id while it copies (read as absent)
    sseq: str = ""
    closer: str = ""
    held: int = 0  # bytes charged (charge()) since its creation
    log: list[bytes] = field(default_factory=list)
    prods: dict[str, tuple[int, int]] = field(default_factory=dict)
    forks: set[str] = field(default_factory=set)
    expires: float | None = None  # by the store's clock


class MemoryStreams:
    """See the module docstring."""

    _on_message: MessageHandler | None

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._by_meta: dict[str, _Stream] = {}  # the streams, by their meta key
        self._tapped: set[str] = set()
        self._windows: dict[str, dict[int, int]] = {}  # take_bytes: key -> step -> bytes

    # ---- the tap (live readers' wake-ups) --------------------------------------------------

    async def tap_subscribe(self, channel: str) -> None:
        self._tapped.add(channel)

    def tap_unsubscribe(self, channel: str) -> None:
        self._tapped.discard(channel)

    def _wake(self, channel: str, data: bytes) -> None:
        if channel in self._tapped and self._on_message is not None:
            msg = [b"smessage", channel.encode(), data]
            handler = self._on_message
            asyncio.get_running_loop().call_soon(handler, [msg])

    # ---- the streams ----------------------------------------------------------------------

    def _get(self, ref: StreamRef) -> _Stream | None:
        s = self._by_meta.get(ref.meta)
        if s is not None and s.expires is not None and s.expires <= self._clock():
            del self._by_meta[ref.meta]
            return None
        return s

    def _expire(self, s: _Stream, persist: bool = False) -> None:
        if s.ttl:
            s.expires = self._clock() + int(s.ttl)
        elif s.eams:
            s.expires = self._clock() + (int(s.eams) / 1000 - time.time())
        elif persist:
            s.expires = None

    def _build(self, ref: StreamRef, s: _Stream | None, w: StreamWrite,
               messages: Sequence[bytes]) -> StreamWriteResult:  # fmt: skip
        if s is not None and s.building != w.build:
            return StreamWriteResult(409, 0, False, 0, 0)
        held, size = (0 if s is None else s.held), charge(messages)
        if w.max_bytes > 0 and messages and held + size > w.max_bytes:
            return StreamWriteResult(413, 0 if s is None else len(s.log), False, held, w.max_bytes)
        if s is None:
            s = _Stream(w.media_type, "", "", "", "", "", w.build, building=w.build)
            self._by_meta[ref.meta] = s
        s.log.extend(messages)
        s.held += size if messages else 0
        s.expires = self._clock() + BUILD_S
        return StreamWriteResult(202, len(s.log), False, 0, 0)

    async def stream_write(
        self, ref: StreamRef, w: StreamWrite, messages: Sequence[bytes]
    ) -> StreamWriteResult:
        s = self._get(ref)
        ttl = "" if w.ttl is None else str(w.ttl)
        ea = "" if w.expires_at is None else w.expires_at[0]
        if w.op == "build":
            return self._build(ref, s, w, messages)
        if w.op == "put":
            built = s is not None and bool(s.building) and s.building == w.build
            if w.build and not built:
                return StreamWriteResult(412, 0, False, 0, 0)
            if s is not None and not built:
                same = (s.mt == w.media_type and s.ttl == ttl and s.ea == ea
                        and s.closed == w.close and not s.deleted and s.fork == w.fork
                        and not s.building)  # fmt: skip
                return StreamWriteResult(200 if same else 409, len(s.log), s.closed, 0, 0)
            held = s.held if s is not None else 0  # a build's copied bytes
            size = charge(messages)
            if w.max_bytes > 0 and messages and held + size > w.max_bytes:
                return StreamWriteResult(413, 0, False, held, w.max_bytes)
            eams = "" if w.expires_at is None else str(w.expires_at[1])
            log = s.log if s is not None else []
            s = _Stream(w.media_type, w.content_type, ttl, ea, eams, w.fork,
                        w.build or secrets.token_hex(6), closed=w.close, log=log)  # fmt: skip
            self._by_meta[ref.meta] = s
            s.log.extend(messages)
            s.held = held + (size if messages else 0)
            self._expire(s, persist=built)
            if s.log or w.close:
                self._wake(ref.channel, str(len(s.log)).encode())
            return StreamWriteResult(201, len(s.log), w.close, 0, 0)
        if s is None or s.building:
            return StreamWriteResult(404, 0, False, 0, 0)
        if s.deleted:
            return StreamWriteResult(410, 0, False, 0, 0)
        n = len(s.log)
        pid, epoch, seq = w.producer if w.producer is not None else ("", 0, 0)
        tuple_ = f"{pid}\n{epoch}\n{seq}" if pid else ""
        if s.closed:
            if tuple_ and s.closer == tuple_:
                return StreamWriteResult(204, n, True, epoch, seq)
            if w.close and not w.has_body:
                return StreamWriteResult(204, n, True, 0, 0)
            return StreamWriteResult(409, n, True, 0, 0)
        if w.has_body and s.mt != w.media_type:
            return StreamWriteResult(409, n, False, 0, 0)
        if pid:
            st = s.prods.get(pid)
            if st is not None:
                se, sq = st
                if epoch < se:
                    return StreamWriteResult(403, n, False, se, 0)
                if epoch > se:
                    if seq != 0:
                        return StreamWriteResult(400, n, False, 0, 0)
                elif seq <= sq:
                    return StreamWriteResult(204, n, False, epoch, sq)
                elif seq != sq + 1:
                    return StreamWriteResult(409, n, False, sq + 1, seq)
            elif seq != 0:
                return StreamWriteResult(409, n, False, 0, seq)
        size = charge(messages)
        if w.max_bytes > 0 and messages and s.held + size > w.max_bytes:
            return StreamWriteResult(413, n, False, s.held, w.max_bytes)
        if w.stream_seq:
            if s.sseq and w.stream_seq <= s.sseq:
                return StreamWriteResult(409, n, False, 0, 0)
            s.sseq = w.stream_seq
        if pid:
            s.prods[pid] = (epoch, seq)
        s.log.extend(messages)
        s.held += size if messages else 0
        n = len(s.log)
        if w.close:
            s.closed = True
            if tuple_:
                s.closer = tuple_
        self._expire(s)
        self._wake(ref.channel, str(n).encode())
        if pid:
            return StreamWriteResult(200, n, w.close, epoch, seq)
        return StreamWriteResult(204, n, w.close, 0, 0)

    async def stream_read(
        self, ref: StreamRef, start: int | None, *, count: int, touch: bool = True,
        max_bytes: int = 0,
    ) -> StreamView | None:  # fmt: skip
        s = self._get(ref)
        if s is None or s.building:
            return None
        if s.deleted:
            raise SoftDeleted(ref.path)
        if touch and s.ttl:
            s.expires = self._clock() + int(s.ttl)
        n = len(s.log)
        frm = n if start is None else start
        out: list[bytes] = []
        if 0 <= frm < n and count > 0:
            size = 0
            for m in s.log[frm : min(n, frm + count)]:
                if max_bytes > 0 and out and size + len(m) > max_bytes:
                    break
                out.append(m)
                size += len(m)
        ttl = int(s.ttl) if s.ttl else None
        return StreamView(s.mt, s.ct, ttl, s.ea, s.closed, n, s.gen, 0, frm, out)

    def _source_of(self, s: _Stream) -> str:
        return s.fork.split("\n", 1)[0] if "\n" in s.fork else ""

    async def stream_delete(self, ref: StreamRef) -> tuple[int, str]:
        s = self._get(ref)
        if s is None or s.building:
            return 404, ""
        if s.deleted:
            return 410, ""
        self._wake(ref.channel, b"deleted")
        if s.forks:  # forks hold copies: the data goes, the tombstone blocks the path
            s.deleted = True
            s.log, s.prods = [], {}
            return 204, ""
        del self._by_meta[ref.meta]
        return 204, self._source_of(s)

    async def take_bytes(self, key: str, n: int, limit: int, window_ms: int) -> int:
        now = round(self._clock() * 1000)
        step = max(window_ms // 60, 1000)
        first = (now - window_ms) // step + 1
        live = {b: v for b, v in self._windows.get(key, {}).items() if b >= first}
        self._windows[key] = live
        used = sum(live.values())
        if n > 0 and used + n > limit:
            if n > limit:
                return -1
            over = used + n - limit
            for b in sorted(live):
                over -= live[b]
                if over <= 0:
                    return max(b * step + window_ms - now, 1000)
            return window_ms
        live[now // step] = live.get(now // step, 0) + n
        return 0

    async def stream_forks(self, ref: StreamRef, limit: int) -> list[str]:
        s = self._get(ref)
        return [] if s is None else sorted(s.forks)[:limit]

    async def stream_fork_ref(self, source: StreamRef, fork_path: str, take: bool) -> str:
        s = self._get(source)
        if take:
            if s is None or s.deleted or s.building:
                return ""
            s.forks.add(fork_path)
            return "1"
        if s is None:
            return ""
        s.forks.discard(fork_path)
        if s.deleted and not s.forks:
            del self._by_meta[source.meta]
            return self._source_of(s)
        return ""
