"""A WebSocket stream after its upgrade, owned by the relay, not by aiohttp.

aiohttp answers the upgrade request (the 101, written by :func:`upgrade`); then the
socket's transport is handed to a :class:`WsConn` and aiohttp is told the connection
is gone (:func:`detach`), so that its request, parser, handler task and WebSocket
objects are freed: an idle WebSocket holds the transport, the stream's watch and this
one small protocol object, no task and no coroutine (about 4 KB less than the request
machinery aiohttp keeps while a handler runs).

What a :class:`WsConn` does (everything aiohttp's ``WebSocketResponse`` did for the
relay, with the same close codes):

- reads the client's frames (:class:`relay.edge.wsframes.WsParser`): a
  ``{"type":"ping"}`` text, a ping (answered with a pong) or a pong marks the client as
  heard from (:mod:`relay.edge.beats` pings the silent ones); any other text message
  ends the stream with ``bad_message`` (4400), a binary one with ``binary`` (1003); a
  protocol error is answered with its close code (1002, 1007, 1009);
- frames reach the socket from the hub's reader through the stream's
  :class:`relay.edge.streams.SocketOut` (this object is its writer: :meth:`drain`
  waits for the transport to resume writing); a task runs only to drain a socket that
  pushed back, or to close the stream with the reason its watch closed;
- closes: a close frame with the code and reason, then up to ``CLOSE_WAIT_S`` for the
  client's own close frame, then the transport; a client's close frame is answered;
- once the transport is lost, ends the stream (``host.end_stream``, once) and
  completes :attr:`done`, which the server's drain waits on (cancelling it aborts the
  connection).

Order of use (:func:`relay.edge.handlers.ws_handler`)::

    resp, transport = await upgrade(request)     # 101 sent; aiohttp forgets the socket
    conn = WsConn(host, stream, transport, max_message)
    conn.start(hello)                            # hello frame, frames from now on
    return resp                                  # the handler ends; the stream goes on
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
from typing import Any, Final

from aiohttp import hdrs, web

from relay.edge.host import StreamHost
from relay.edge.streams import (
    WS_CLOSE,
    SocketOut,
    Stream,
    Transport,
    client_reason,
    is_ping,
    ws_bytes,
    ws_text_frame,
)
from relay.edge.wsframes import (
    BINARY,
    CLOSE,
    PING,
    TEXT,
    WsError,
    WsParser,
    close_frame,
    pong_frame,
)
from relay.protocol.codes import CloseCode, WsClose
from relay.redisio.errors import WatchClosed

__all__ = ["CLOSE_WAIT_S", "WsConn", "detach", "upgrade"]

log = logging.getLogger(__name__)

CLOSE_WAIT_S: Final = 2.0  # how long a close waits for the client's close frame
_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


async def upgrade(request: web.Request) -> tuple[web.StreamResponse, asyncio.Transport]:
    """Answer a checked upgrade request (``WebSocketResponse.can_prepare`` said ok) with
    101, then :func:`detach` its socket from aiohttp. Raises ConnectionResetError if the
    client is gone."""
    key = request.headers[hdrs.SEC_WEBSOCKET_KEY].strip().encode()
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode()
    resp = web.StreamResponse(
        status=101,
        headers={
            hdrs.UPGRADE: "websocket",
            hdrs.CONNECTION: "upgrade",
            hdrs.SEC_WEBSOCKET_ACCEPT: accept,
        },
    )
    resp.force_close()  # no HTTP keep-alive after an upgrade
    writer = await resp.prepare(request)
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the upgrade")
    writer.send_headers()  # now, not with the (empty) body at the end of the request
    return resp, transport


def detach(request: web.Request, protocol: asyncio.Protocol) -> None:
    """Give the request's socket to ``protocol`` and make aiohttp forget it: aiohttp's
    connection no longer has a transport (so it writes nothing more to it and does not
    close it when the handler returns), and its ``connection_lost`` runs now, which
    drops the connection from aiohttp's server and frees its request and parser."""
    handler = request.protocol
    transport = request.transport
    assert transport is not None
    transport.set_protocol(protocol)
    handler.transport = None
    handler.connection_lost(None)


class WsConn(asyncio.Protocol):
    """One WebSocket stream's socket. See the module docstring."""

    __slots__ = (
        "_code",
        "_host",
        "_loop",
        "_parser",
        "_paused",
        "_stream",
        "_transport",
        "_waiter",
        "_writer",
        "done",
    )

    chunked: Final = False  # as SocketOut's writer: frames are not HTTP chunks

    def __init__(
        self, host: StreamHost, stream: Stream, transport: asyncio.Transport, max_message: int
    ) -> None:
        self._host, self._stream, self._transport = host, stream, transport
        self._parser = WsParser(max_message)
        self._loop = asyncio.get_running_loop()
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None  # drain, or a close's reply
        self._writer: asyncio.Task[None] | None = None
        self._code: CloseCode | None = None  # why the stream ends, once decided
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.done.add_done_callback(self._done)
        stream.sock = transport
        stream.task = self.done

    def start(self, hello: bytes, write_timeout_s: float) -> None:
        """Write the hello frame and start streaming frames."""
        stream = self._stream
        stream.heard_at = self._loop.time()
        self._transport.write(ws_text_frame(hello))
        stream.out = SocketOut(
            stream,
            self._transport,
            self,  # type: ignore[arg-type]  # a writer with drain(), as SocketOut needs
            ws_bytes,
            self._host.sender(Transport.WS),
            write_timeout_s,
        )
        stream.watch.attach(stream.out, self._wake)

    # -- the transport's callbacks ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._code is not None and not self._waiter:
            return  # ending: nothing more is read but the client's close
        try:
            msgs = self._parser.feed(data)
        except WsError as exc:
            self._refuse(exc)
            return
        stream = self._stream
        stream.heard_at, stream.pinged_at = self._loop.time(), 0.0  # the client is alive
        for op, payload in msgs:
            if op == TEXT:
                if not is_ping(payload):  # type: ignore[arg-type]
                    self._client_broke(CloseCode.BAD_MESSAGE)
                    return
            elif op == PING:
                self._transport.write(pong_frame(payload))  # type: ignore[arg-type]
            elif op == BINARY:
                self._client_broke(CloseCode.BINARY)
                return
            elif op == CLOSE:
                self._client_closed()
                return

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        stream = self._stream
        code = self._code
        if code is None:
            code = stream.stop[0] if stream.stop is not None else CloseCode.CLIENT_GONE
        self._wake_waiter()
        self._finish(code)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_waiter()

    # -- as SocketOut's writer ---------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until the transport takes writes again (ConnectionResetError if lost)."""
        if self._transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        if not self._paused:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._transport.is_closing():
            raise ConnectionResetError("the connection is closing")

    # -- ending ------------------------------------------------------------------------------

    def _refuse(self, exc: WsError) -> None:
        """A protocol error: its close code (1002, 1007, 1009) and the socket closed."""
        self._code = (
            CloseCode.TOO_BIG if exc.code == WsClose.MESSAGE_TOO_BIG else (CloseCode.CLIENT_GONE)
        )
        self._stop_writer()
        self._transport.write(close_frame(exc.code))
        self._transport.close()

    def _client_broke(self, code: CloseCode) -> None:
        """A message the protocol does not allow: closed by us, with the reason."""
        self._code = code
        self._stop_writer()
        self._spawn_close(code, client_reason(code))

    def _client_closed(self) -> None:
        waiter = self._waiter
        if self._code is not None and waiter is not None:  # the reply to our close
            if not waiter.done():
                waiter.set_result(None)
            return
        if self._code is None:
            s = self._stream
            self._code = s.stop[0] if s.stop is not None else CloseCode.CLIENT_GONE
        self._stop_writer()
        self._transport.write(close_frame(WsClose.NORMAL))
        self._transport.close()

    def _wake(self) -> None:
        """The tap calls for a writer: drain a pushed-back socket, or close the stream."""
        task = self._writer
        if self._code is not None or (task is not None and not task.done()):
            return
        self._writer = asyncio.create_task(self._write(), name=f"ws-writer:{self._stream.sid}")

    async def _write(self) -> None:
        stream = self._stream
        try:
            await stream.watch.drain()
            return
        except WatchClosed as exc:
            code, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            return
        except Exception:  # never leave a socket nobody closes
            log.exception("WebSocket writer of %s failed", stream.sid)
            code, reason = CloseCode.INTERNAL, "internal error"
        if stream.stop is None:
            stream.stop = (code, reason)
        self._code = code
        await self._close(code, reason)

    def _spawn_close(self, code: CloseCode, reason: str) -> None:
        task = asyncio.create_task(self._close(code, reason), name=f"ws-close:{self._stream.sid}")
        self._writer = task

    async def _close(self, code: CloseCode, reason: str) -> None:
        """Our close frame, up to CLOSE_WAIT_S for the client's, then the transport."""
        num, default = WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])
        t = self._transport
        if t.is_closing():
            return
        t.write(close_frame(num, (reason or default).encode()[:120]))
        self._waiter = waiter = self._loop.create_future()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, CLOSE_WAIT_S)
        finally:
            self._waiter = None
            t.close()

    def _stop_writer(self) -> None:
        task = self._writer
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def _wake_waiter(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _finish(self, code: CloseCode) -> None:
        stream = self._stream
        self._stop_writer()
        stream.out = None
        if not self.done.done():  # (cancelled: _done ended the stream already)
            self._host.end_stream(stream, code)
            self.done.set_result(None)

    def _done(self, fut: asyncio.Future[Any]) -> None:
        """The server's drain cancelled the wait for this stream: abort it now."""
        if fut.cancelled():
            stream = self._stream
            self._transport.abort()
            code = stream.stop[0] if stream.stop is not None else CloseCode.CLIENT_GONE
            stream.out = None
            self._stop_writer()
            self._host.end_stream(stream, code)
