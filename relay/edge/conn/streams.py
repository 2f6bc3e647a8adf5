"""Per-connection pieces of the edge server: the stream record, the socket port,
refusals, close codes.

Used by :mod:`relay.edge.http.server` only. :class:`Stream` is one open SSE / WebSocket stream
(its hub tap, its task, why the server ends it); :class:`SocketOut` is the socket as a
:class:`relay.edge.fanout.tap.Tap` writes to it (pre-encoded bytes straight to the transport, one
write per batch; SSE events and WebSocket text frames encoded once per relay and kept on
the delivery every watcher of the session shares, :func:`sse_bytes`, :func:`ws_bytes`);
:class:`Reject` is a refusal before
streaming (JSON ``{"error", "reason"}``); :data:`WS_CLOSE` maps every stop code to its
WebSocket close code (the table of docs/PROTOCOL.md).

Order of use: the server builds a :class:`Stream` once the watch is open and a
:class:`SocketOut` once the response is prepared, calls :meth:`Stream.kick` to end it
from outside (drain) and :meth:`Stream.cut` from a write timer; the stream's task reads
:meth:`Stream.ended` to learn why it ended.
"""

from __future__ import annotations

import asyncio
import enum
import random
import struct
from collections.abc import Callable
from typing import Any, Final, Protocol
from urllib.parse import parse_qsl

import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from relay.broker.errors import WatchClosed
from relay.edge.core.resume import Delivery
from relay.edge.fanout.tap import Tap
from relay.protocol import sse
from relay.protocol.codes import CloseCode, WsClose
from relay.protocol.frame import KINDS

__all__ = [
    "CORS_HEADERS",
    "GOODBYE_S",
    "WS_CLOSE",
    "WS_PING",
    "Releasable",
    "SocketOut",
    "Stream",
    "Transport",
    "client_reason",
    "discard",
    "is_ping",
    "jitter",
    "query_value",
    "sse_bytes",
    "ws_bytes",
    "ws_text_frame",
]


class Transport(enum.StrEnum):
    """How a stream reaches its client (the ``transport`` label of the metrics)."""

    SSE = "sse"
    WS = "ws"
    UI = "ui"  # the AI SDK UI message stream (SSE framing of its own)


# WebSocket close codes the server uses, by WatchClosed / server stop code.
WS_CLOSE: Final[dict[CloseCode, tuple[WsClose, str]]] = {
    CloseCode.RELAY_SHUTDOWN: (WsClose.SERVICE_RESTART, "service restart"),
    CloseCode.SLOW_CONSUMER: (WsClose.SLOW_CONSUMER, "slow consumer"),
    CloseCode.TOKEN_EXPIRED: (WsClose.TOKEN_EXPIRED, "token expired"),
    CloseCode.BAD_MESSAGE: (WsClose.BAD_MESSAGE, "bad message"),
    CloseCode.BINARY: (WsClose.UNSUPPORTED_DATA, "binary messages are not supported"),
    CloseCode.TOO_BIG: (WsClose.MESSAGE_TOO_BIG, "message too big"),
    CloseCode.INTERNAL: (WsClose.INTERNAL_ERROR, "internal error"),
    CloseCode.CLOSED: (WsClose.NORMAL, "closed"),
}
CORS_HEADERS: Final = {
    "Access-Control-Allow-Headers": "Authorization, Last-Event-ID, Content-Type",
    "Access-Control-Allow-Methods": "GET, OPTIONS",
    "Access-Control-Expose-Headers": "X-Relay-Id",
    "Access-Control-Max-Age": "600",
}


class Releasable(Protocol):
    """What a stream holds until it ends (its :class:`relay.edge.http.limits.Ticket`)."""

    def release(self) -> None: ...


class Stream:
    """One open SSE or WebSocket stream: its watch, its task, why the server ends it."""

    __slots__ = (
        "heard_at",
        "offset",
        "out",
        "pinged_at",
        "sid",
        "sock",
        "stop",
        "task",
        "ticket",
        "transport",
        "watch",
    )

    def __init__(self, transport: Transport, sid: str, offset: int | None, watch: Tap) -> None:
        self.transport, self.sid, self.offset, self.watch = transport, sid, offset, watch
        self.stop: tuple[CloseCode, str] | None = None
        # what the server's drain waits on: the handler's task, or the detached
        # connection's future (relay.edge.conn.detached.Detached.done)
        self.task: asyncio.Future[Any] | None = asyncio.current_task()
        self.sock: asyncio.Transport | None = None
        self.out: SocketOut | None = None  # set while frames stream
        self.ticket: Releasable | None = None  # its share of the server's stream limits
        # WebSocket liveness (the server's heartbeat timer): when the client was last
        # heard from, and when a ping went unanswered since (0.0: none is out)
        self.heard_at = 0.0
        self.pinged_at = 0.0

    def cut(self) -> None:
        """A write did not finish in time: the client is slow. Abort the connection
        (its buffers are full: no goodbye would get through); the pending write fails
        with ConnectionResetError in the stream's task. No task is cancelled."""
        if self.stop is None:
            self.stop = (CloseCode.SLOW_CONSUMER, "the client does not read fast enough")
        if self.sock is not None:
            self.sock.abort()

    async def kick(self, code: CloseCode, reason: str) -> None:
        """End the stream from outside: its writer wakes with WatchClosed and says why."""
        if self.stop is None:
            self.stop = (code, reason)
        await self.watch.close()

    def ended(self, exc: WatchClosed) -> tuple[CloseCode, str]:
        return self.stop if self.stop is not None else (exc.code, exc.reason)

    def gone(self) -> CloseCode:
        """Why a stream ended that the server did not end itself (the client went away,
        or its connection was lost or cut): the server's reason if it had one (a slow
        consumer cut, a drain), else ``client_gone``."""
        return self.stop[0] if self.stop is not None else CloseCode.CLIENT_GONE


WS_PING: Final = b"\x89\x00"  # an empty, unmasked, final ping frame (RFC 6455 5.5.2)


def ws_text_frame(payload: bytes) -> bytes:
    """One unmasked, final WebSocket text frame (RFC 6455 section 5.2), as a server sends."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x81, 126, n) + payload
    return struct.pack("!BBQ", 0x81, 127, n) + payload


_EVENT_KINDS: Final = {k: k.encode() for k in KINDS}


def sse_bytes(d: Delivery) -> bytes:
    """``d`` as one SSE event (``id:`` offset, ``event:`` kind, ``data:`` the frame as
    published), made once per delivery and kept on it (:attr:`Delivery.sse`)."""
    out = d.sse
    if out is None:
        data, kind = d.data, _EVENT_KINDS.get(d.kind)
        if kind is None or 10 in data or 13 in data:  # LF, CR (JSON with line breaks)
            out = sse.event(data, id=d.offset, kind=d.kind)
        else:  # what sse.event writes, in one step
            out = b"id: %d\nevent: %b\ndata: %b\n\n" % (d.offset, kind, data)
        d.sse = out
    return out


def ws_bytes(d: Delivery) -> bytes:
    """``d`` as one WebSocket text frame, made once per delivery (:attr:`Delivery.ws`)."""
    out = d.ws
    if out is None:
        out = d.ws = ws_text_frame(d.data)
    return out


class SocketOut:
    """A prepared SSE response or WebSocket as a :class:`relay.edge.fanout.tap.Tap` writes to it.

    :meth:`send` writes a batch's pre-encoded bytes in one ``transport.write`` (for a
    chunked HTTP response, inside one chunk), :meth:`room` says whether the transport is
    below its write high-water mark, :meth:`drain` waits for it to resume writing (past
    ``timeout_s`` the stream is cut as a slow consumer)."""

    __slots__ = (
        "_chunked",
        "_encode",
        "_high",
        "_loop",
        "_on_sent",
        "_stream",
        "_timeout_s",
        "_transport",
        "_writer",
        "last_write",
    )

    def __init__(
        self,
        stream: Stream,
        transport: asyncio.Transport,
        writer: AbstractStreamWriter,
        encode: Callable[[Delivery], bytes],
        on_sent: Callable[[list[Delivery], int], None],
        timeout_s: float,
    ) -> None:
        self._stream = stream
        self._transport = transport
        self._writer = writer
        self._encode = encode  # sse_bytes or ws_bytes
        self._on_sent = on_sent
        self._timeout_s = timeout_s
        self._chunked = bool(getattr(writer, "chunked", False))
        self._high = transport.get_write_buffer_limits()[1]
        self._loop = asyncio.get_running_loop()
        self.last_write = self._loop.time()

    def room(self) -> bool:
        t = self._transport
        return not t.is_closing() and t.get_write_buffer_size() <= self._high

    def write(self, data: bytes) -> None:
        """Raw bytes (a heartbeat), framed as one HTTP chunk when the response is chunked."""
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._transport.write(data)
        self.last_write = self._loop.time()

    def send(self, ds: list[Delivery]) -> None:
        encode = self._encode
        data = encode(ds[0]) if len(ds) == 1 else b"".join([encode(d) for d in ds])
        n = len(data)
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (n, data)
        self._transport.write(data)
        self.last_write = self._loop.time()
        self._on_sent(ds, n)

    async def drain(self) -> None:
        if self._transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        handle = self._loop.call_later(self._timeout_s, self._stream.cut)
        try:
            await self._writer.drain()
        finally:
            handle.cancel()


GOODBYE_S: Final = 1.0


def jitter(retry_ms: int) -> int:
    """Spread reconnects after a drain over [retry/2, retry] so peers are not stampeded."""
    return retry_ms // 2 + random.randint(0, max(retry_ms // 2, 0))


def discard(task: asyncio.Task[Any] | None) -> None:
    """Cancel a helper task, or consume its outcome if it already finished."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def query_value(request: web.Request, name: str) -> str | None:
    """The first ``name`` parameter of the request's query string (decoded, ``+`` as a
    space), or None. Parsed here and dropped: ``request.query`` would keep a parsed
    copy of the query with the request for as long as the stream lasts."""
    raw = request.rel_url.raw_query_string
    if not raw:
        return None
    for key, value in parse_qsl(raw, keep_blank_values=True):
        if key == name:
            return value
    return None


def is_ping(text: str) -> bool:
    if len(text) > 64:
        return False
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("type") == "ping"


def client_reason(code: CloseCode) -> str:
    if code is CloseCode.BAD_MESSAGE:
        return 'client messages must be {"type":"ping"}'
    return WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])[1]
