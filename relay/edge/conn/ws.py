"""A WebSocket stream (``GET /v1/sessions/{sid}/ws``) as one connection.

:func:`upgrade` answers the upgrade request with 101; the handler then hands the socket
to a :class:`WsConn` (:func:`relay.edge.http.handlers.detach`) and returns, so that aiohttp's
request, parser, handler task and WebSocket objects are freed.

What a :class:`WsConn` adds to :class:`relay.edge.conn.base.Conn` (what aiohttp's
``WebSocketResponse`` did for the relay, with the same close codes):

- each frame is one text message (the frame JSON as published, framed once per frame
  and shared: :func:`relay.edge.conn.base.ws_bytes`);
- it reads the client's frames (:class:`relay.edge.core.wsframes.WsParser`, made only
  while a message is incomplete): a ``{"type":"ping"}`` text, a ping (answered with a
  pong) or a pong marks the client as heard from; any other text message ends the
  stream with ``bad_message`` (4400), a binary one with ``binary`` (1003); a protocol
  error is answered with its close code (1002, 1007, 1009) and the socket closed;
- the server's heartbeat timer (:mod:`relay.edge.conn.beats`) pings a client silent for
  ``heartbeat_s`` and aborts one whose ping stays unanswered ``heartbeat_s / 2`` later
  (a dead peer; the stream ends with ``client_gone``);
- its goodbye is a close frame with the code and reason (:data:`WS_CLOSE`), then up to
  ``CLOSE_WAIT_S`` for the client's own close frame; a client's close frame is answered
  with ours.

Order of use (:func:`relay.edge.http.handlers.ws_handler`)::

    conn = WsConn(hub, sid, offset, gen, host=server, max_message=...)
    await server.admit(conn)
    resp, transport = await upgrade(request)      # 101 sent
    conn.attach(detach(request, conn), ws_text_frame(hello))
    return resp                                   # the handler ends; the stream goes on
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
from typing import Any, ClassVar, Final

import orjson
from aiohttp import hdrs, web

from relay.edge.conn.base import Conn, ws_bytes
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
from relay.edge.fanout.hub import Hub
from relay.protocol.codes import CloseCode, WsClose
from relay.service.tokens import WS_PROTOCOL, offered_protocols

__all__ = ["CLOSE_WAIT_S", "WS_CLOSE", "WS_PING", "WsConn", "client_reason", "is_ping", "upgrade"]

log = logging.getLogger(__name__)

CLOSE_WAIT_S: Final = 2.0  # how long a close waits for the client's close frame
WS_PING: Final = b"\x89\x00"  # an empty, unmasked, final ping frame (RFC 6455 5.5.2)
# The WebSocket close code and default reason sent for each stop code.
WS_CLOSE: Final[dict[CloseCode, tuple[WsClose, str]]] = {
    CloseCode.RELAY_SHUTDOWN: (WsClose.SERVICE_RESTART, "service restart"),
    CloseCode.SLOW_CONSUMER: (WsClose.SLOW_CONSUMER, "slow consumer"),
    CloseCode.TOKEN_EXPIRED: (WsClose.TOKEN_EXPIRED, "token expired"),
    CloseCode.BAD_MESSAGE: (WsClose.BAD_MESSAGE, "bad message"),
    CloseCode.BINARY: (WsClose.UNSUPPORTED_DATA, "binary messages are not supported"),
    CloseCode.TOO_BIG: (WsClose.MESSAGE_TOO_BIG, "message too big"),
    CloseCode.INTERNAL: (WsClose.INTERNAL_ERROR, "internal error"),
    CloseCode.SESSION_DELETED: (WsClose.SESSION_DELETED, "the session was deleted"),
    CloseCode.CLOSED: (WsClose.NORMAL, "closed"),
}
_GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3


async def upgrade(request: web.Request) -> tuple[web.StreamResponse, asyncio.Transport]:
    """Answer a checked upgrade request (``WebSocketResponse.can_prepare`` said ok) with
    101, sent now; with the subprotocol ``tokenrelay`` when the client offers it (the
    one it sends its token beside: :func:`relay.service.tokens.protocol_token`).
    Raises ConnectionResetError if the client is gone."""
    key = request.headers[hdrs.SEC_WEBSOCKET_KEY].strip().encode()
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode()
    headers = {
        hdrs.UPGRADE: "websocket",
        hdrs.CONNECTION: "upgrade",
        hdrs.SEC_WEBSOCKET_ACCEPT: accept,
    }
    if WS_PROTOCOL in offered_protocols(request):  # never the token's own subprotocol
        headers[hdrs.SEC_WEBSOCKET_PROTOCOL] = WS_PROTOCOL
    resp = web.StreamResponse(status=101, headers=headers)
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


class WsConn(Conn):
    """One WebSocket stream. See the module docstring."""

    transport_kind: ClassVar[str] = "ws"
    encode = staticmethod(ws_bytes)

    __slots__ = ("_ending", "_max_message", "_parser", "_reply", "heard_at", "pinged_at")

    def __init__(self, hub: Hub, sid: str, offset: int | None, gen: str | None = None,
                 *, max_message: int = 4096, **kw: Any) -> None:  # fmt: skip
        super().__init__(hub, sid, offset, gen, **kw)
        self._max_message = max_message
        self._parser: WsParser | None = None  # only while a client message is incomplete
        self._reply: asyncio.Future[None] | None = None  # the client's close, awaited
        self._ending = False
        # liveness: when the client was last heard from, and when a ping went
        # unanswered since (0.0: none is out)
        self.heard_at = 0.0
        self.pinged_at = 0.0

    def attach(self, transport: asyncio.Transport, first: bytes = b"") -> None:
        self.heard_at = self._loop.time()
        super().attach(transport, first)

    def beat(self, now: float, heartbeat_s: float) -> None:
        """A ping when the client was silent for ``heartbeat_s``; the connection aborted
        when that ping is unanswered ``heartbeat_s / 2`` later."""
        if self.pinged_at:
            if now - self.pinged_at >= heartbeat_s / 2:
                log.info("WebSocket of %s: no pong within %.1f s; closing", self.sid,
                         heartbeat_s / 2)  # fmt: skip
                self.abort()
        elif self.heard_at <= now - heartbeat_s and self.idle_room():
            self.write_raw(WS_PING)
            self.pinged_at = now

    def data_received(self, data: bytes) -> None:
        if self._ending and self._reply is None:
            return  # ending: nothing more is read but the reply to our close
        parser = self._parser or WsParser(self._max_message)
        try:
            msgs = parser.feed(data)
        except WsError as exc:
            self._refuse(exc)
            return
        self._parser = None if parser.idle else parser
        self.heard_at, self.pinged_at = self._loop.time(), 0.0  # the client is alive
        t = self._transport
        for op, payload in msgs:
            if op == TEXT:
                if not is_ping(payload):  # type: ignore[arg-type]
                    self._client_broke(CloseCode.BAD_MESSAGE)
                    return
            elif op == PING:
                if t is not None:
                    t.write(pong_frame(payload))  # type: ignore[arg-type]
            elif op == BINARY:
                self._client_broke(CloseCode.BINARY)
                return
            elif op == CLOSE:
                self._client_closed()
                return

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """Our close frame, then up to CLOSE_WAIT_S for the client's."""
        self._ending = True
        num, default = WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])
        t = self._transport
        if t is None:
            return
        t.write(close_frame(num, (reason or default).encode()[:120]))
        self._reply = reply = self._loop.create_future()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reply, CLOSE_WAIT_S)
        finally:
            self._reply = None

    def _refuse(self, exc: WsError) -> None:
        """A protocol error: its close code (1002, 1007, 1009) and the socket closed."""
        self._ending = True
        too_big = exc.code == WsClose.MESSAGE_TOO_BIG
        if self.stop is None:
            code = CloseCode.TOO_BIG if too_big else CloseCode.CLIENT_GONE
            self.stop = (code, exc.reason)
        self._stop_writer()
        if self._transport is not None:
            self._transport.write(close_frame(exc.code))
        self.close_transport()

    def _client_broke(self, code: CloseCode) -> None:
        """A message the protocol does not allow: closed by us, with the reason."""
        self._ending = True
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
        self._ending = True
        self._stop_writer()
        if self._transport is not None:
            self._transport.write(close_frame(WsClose.NORMAL))
        self.close_transport()


def is_ping(text: str) -> bool:
    """The one text message a client may send: ``{"type":"ping"}``."""
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
