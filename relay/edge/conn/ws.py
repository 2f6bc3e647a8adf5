"""A WebSocket stream after its upgrade, owned by the relay, not by aiohttp.

:func:`upgrade` answers the upgrade request with 101; the handler then hands the socket
to a :class:`WsConn` (:func:`relay.edge.conn.detached.detach`) and returns, so that aiohttp's
request, parser, handler task and WebSocket objects are freed
(:mod:`relay.edge.conn.detached` says what every detached stream does).

What a :class:`WsConn` adds (what aiohttp's ``WebSocketResponse`` did for the relay,
with the same close codes):

- it reads the client's frames (:class:`relay.edge.core.wsframes.WsParser`): a
  ``{"type":"ping"}`` text, a ping (answered with a pong) or a pong marks the client as
  heard from (:mod:`relay.edge.conn.beats` pings the silent ones); any other text message
  ends the stream with ``bad_message`` (4400), a binary one with ``binary`` (1003); a
  protocol error is answered with its close code (1002, 1007, 1009) and the socket
  closed;
- its goodbye is a close frame with the code and reason, then up to ``CLOSE_WAIT_S``
  for the client's own close frame; a client's close frame is answered with ours.

Order of use (:func:`relay.edge.http.handlers.ws_handler`)::

    resp, transport = await upgrade(request)      # 101 sent
    conn = WsConn(host, stream, transport, max_message)
    detach(request, conn)                         # aiohttp forgets the socket
    conn.start(ws_text_frame(hello), ws_bytes, sent, write_timeout_s)
    return resp                                   # the handler ends; the stream goes on
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from typing import Final

from aiohttp import hdrs, web

from relay.edge.conn.detached import Detached
from relay.edge.conn.streams import WS_CLOSE, Stream, client_reason, is_ping
from relay.edge.core.wsframes import (
    BINARY,
    CLOSE,
    PING,
    TEXT,
    WsError,
    WsParser,
    close_frame,
    pong_frame,
)
from relay.edge.http.host import StreamHost
from relay.protocol.codes import CloseCode, WsClose

__all__ = ["CLOSE_WAIT_S", "WsConn", "upgrade"]

CLOSE_WAIT_S: Final = 2.0  # how long a close waits for the client's close frame
_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


async def upgrade(request: web.Request) -> tuple[web.StreamResponse, asyncio.Transport]:
    """Answer a checked upgrade request (``WebSocketResponse.can_prepare`` said ok) with
    101, sent now. Raises ConnectionResetError if the client is gone."""
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
    # now, not with the (empty) body at the end of the request: recent aiohttp keeps
    # the head until then (send_headers); older releases sent it in prepare
    send_headers = getattr(writer, "send_headers", None)
    if send_headers is not None:
        send_headers()
    return resp, transport


class WsConn(Detached):
    """One WebSocket stream's socket. See the module docstring."""

    __slots__ = ("_parser", "_reply")

    def __init__(
        self, host: StreamHost, stream: Stream, transport: asyncio.Transport, max_message: int
    ) -> None:
        super().__init__(host, stream, transport)
        self._parser = WsParser(max_message)
        self._reply: asyncio.Future[None] | None = None  # the client's close, awaited
        stream.heard_at = self._loop.time()

    def data_received(self, data: bytes) -> None:
        if self._code is not None and self._reply is None:
            return  # ending: nothing more is read but the reply to our close
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

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """Our close frame, then up to CLOSE_WAIT_S for the client's."""
        num, default = WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])
        self._transport.write(close_frame(num, (reason or default).encode()[:120]))
        self._reply = reply = self._loop.create_future()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reply, CLOSE_WAIT_S)
        finally:
            self._reply = None

    def _refuse(self, exc: WsError) -> None:
        """A protocol error: its close code (1002, 1007, 1009) and the socket closed."""
        too_big = exc.code == WsClose.MESSAGE_TOO_BIG
        self._code = CloseCode.TOO_BIG if too_big else CloseCode.CLIENT_GONE
        self._stop_writer()
        self._transport.write(close_frame(exc.code))
        self.close_transport()

    def _client_broke(self, code: CloseCode) -> None:
        """A message the protocol does not allow: closed by us, with the reason."""
        self.end_soon(code, client_reason(code))

    def connection_lost(self, exc: Exception | None) -> None:
        reply = self._reply
        if reply is not None and not reply.done():
            reply.set_result(None)
        super().connection_lost(exc)

    def _client_closed(self) -> None:
        reply = self._reply
        if reply is not None:  # the reply to our close
            if not reply.done():
                reply.set_result(None)
            return
        if self._code is None:
            self._code = self._stream.gone()
        self._stop_writer()
        self._transport.write(close_frame(WsClose.NORMAL))
        self.close_transport()
