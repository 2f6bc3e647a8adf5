"""The SSE and WebSocket stream handlers of the edge server.

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence (the server's one timer), a
  ``: close <code> <reason>`` comment last. Resume: ``Last-Event-ID`` header or
  ``last_event_id`` query, and ``gen`` (the generation the offset belongs to).
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``
  and ``gen``.
  The handler task reads the client (aiohttp requires it), a writer task streams.

Both are written against :class:`relay.edge.host.StreamHost` (the server's interface to
its handlers). Order of use: :func:`relay.edge.server.make_app` routes the two paths to
:func:`sse_handler` and :func:`ws_handler` with its server as the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from aiohttp import WSMsgType, web
from aiohttp.abc import AbstractStreamWriter

from relay.edge.host import StreamHost
from relay.edge.streams import (
    GOODBYE_S,
    SSE_FRAMES,
    WS_CLOSE,
    WS_FRAMES,
    Reject,
    SocketOut,
    Stream,
    Transport,
    client_reason,
    is_ping,
    jitter,
)
from relay.protocol import frame, sse
from relay.protocol.codes import CloseCode, Refusal, WsClose
from relay.redisio.errors import WatchClosed

__all__ = ["lost_code", "parse_gen", "parse_offset", "sse_handler", "ws_handler"]

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def parse_offset(parse: Callable[[], int | None]) -> int | None:
    """The resume offset ``parse()`` reads from the request, or Reject 400 ``bad_offset``."""
    try:
        return parse()
    except sse.OffsetError as exc:
        raise Reject(400, Refusal.BAD_OFFSET, str(exc)) from None


def parse_gen(request: web.Request) -> str | None:
    """The ``gen`` query parameter (the client's generation), or Reject 400 ``bad_gen``."""
    try:
        return frame.parse_gen(request.query.get("gen"))
    except frame.GenError as exc:
        raise Reject(400, Refusal.BAD_GEN, str(exc)) from None


def lost_code(stream: Stream, code: CloseCode) -> CloseCode:
    """Why a stream whose handler was cancelled by a lost connection ended: the reason
    the server had already decided (slow consumer cut, protocol close) or client_gone."""
    if stream.stop is not None:
        return stream.stop[0]
    return CloseCode.CLIENT_GONE if code is CloseCode.CLOSED else code


def _gone(stream: Stream) -> CloseCode:
    """The client went away, or was cut: the server's reason if it had one."""
    return stream.stop[0] if stream.stop is not None else CloseCode.CLIENT_GONE


# -- SSE ---------------------------------------------------------------------------------


async def sse_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    sid = host.session(request)
    access = host.authorize(request, sid)
    offset = parse_offset(
        lambda: sse.resume_offset(
            request.headers.get("Last-Event-ID"), request.query.get("last_event_id")
        )
    )
    gen = parse_gen(request)
    stream = await host.open_stream(Transport.SSE, sid, offset, access, gen)
    code = CloseCode.CLOSED
    try:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        writer = await resp.prepare(request)
        stream.sock = request.transport
        assert writer is not None
        code = await _sse_loop(host, resp, writer, stream)
        return resp
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        code = lost_code(stream, code)
        raise
    except Exception:
        code = CloseCode.INTERNAL
        raise
    finally:
        await host.close_stream(stream, code)


async def _sse_loop(
    host: StreamHost, resp: web.StreamResponse, writer: AbstractStreamWriter, stream: Stream
) -> CloseCode:
    cfg = host.config

    async def put(data: bytes, timeout_s: float = cfg.write_timeout_s) -> None:
        await host.guarded(stream, resp.write(data), timeout_s)

    try:
        await put(sse.preamble(cfg.retry_ms, host.hello(stream)))  # sends the head too
        assert stream.sock is not None
        stream.out = SocketOut(
            stream,
            stream.sock,
            writer,
            SSE_FRAMES,
            functools.partial(host.sent, Transport.SSE),
            cfg.write_timeout_s,
        )
        await stream.watch.run(stream.out)
    except WatchClosed as exc:
        code, reason = stream.ended(exc)
    except (ConnectionError, RuntimeError):  # the client went away, or was cut
        return _gone(stream)
    finally:
        stream.out = None
    retry = jitter(cfg.retry_ms) if code is CloseCode.RELAY_SHUTDOWN else cfg.retry_ms
    with contextlib.suppress(ConnectionError, RuntimeError):
        await put(sse.goodbye(code, reason, retry), GOODBYE_S)
        await host.guarded(stream, resp.write_eof(), GOODBYE_S)
    return code


# -- WebSocket ---------------------------------------------------------------------------


async def ws_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    sid = host.session(request)
    access = host.authorize(request, sid)
    offset = parse_offset(lambda: sse.parse_offset(request.query.get("from"), name="from"))
    gen = parse_gen(request)
    cfg = host.config
    ws = web.WebSocketResponse(
        heartbeat=cfg.heartbeat_s,
        max_msg_size=cfg.ws_max_message_bytes,
        compress=False,
        timeout=2.0,
    )
    if not ws.can_prepare(request).ok:
        raise Reject(400, Refusal.NOT_WEBSOCKET, "this endpoint needs a WebSocket upgrade")
    stream = await host.open_stream(Transport.WS, sid, offset, access, gen)
    code = CloseCode.CLOSED
    writer: asyncio.Task[CloseCode] | None = None
    try:
        pw = await ws.prepare(request)
        stream.sock = request.transport
        writer = asyncio.create_task(_ws_writer(host, ws, pw, stream), name=f"ws-writer:{sid}")
        seen = await _ws_reader(ws, stream)
        if seen is None:  # the writer ended the stream and closed the socket
            await asyncio.wait([writer])
            code = writer.result() if not writer.cancelled() else CloseCode.CLOSED
        else:
            code = seen
            writer.cancel()
            if code is not CloseCode.CLIENT_GONE:  # the client broke the protocol: we close
                await _ws_close(host, ws, stream, code, client_reason(code))
            await asyncio.wait([writer])
        return ws
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        code = lost_code(stream, code)
        raise
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
        await host.close_stream(stream, code)


async def _ws_reader(ws: web.WebSocketResponse, stream: Stream) -> CloseCode | None:
    """Read the client's messages in the handler task (aiohttp requires it). None: the
    socket closed because the writer ended the stream; else why the client's side ended."""
    while True:
        msg = await ws.receive()
        if msg.type is WSMsgType.TEXT:
            if not is_ping(msg.data):
                return CloseCode.BAD_MESSAGE
        elif msg.type is WSMsgType.BINARY:
            return CloseCode.BINARY
        elif msg.type is WSMsgType.ERROR:  # aiohttp already closed (1009 for too big)
            if ws.close_code == WsClose.MESSAGE_TOO_BIG:
                return CloseCode.TOO_BIG
            return CloseCode.CLIENT_GONE
        elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            return None if stream.stop is not None else CloseCode.CLIENT_GONE


async def _ws_writer(
    host: StreamHost, ws: web.WebSocketResponse, writer: AbstractStreamWriter, stream: Stream
) -> CloseCode:
    timeout_s = host.config.write_timeout_s
    try:
        await host.guarded(stream, ws.send_frame(host.hello(stream), WSMsgType.TEXT), timeout_s)
        assert stream.sock is not None
        stream.out = SocketOut(
            stream,
            stream.sock,
            writer,
            WS_FRAMES,
            functools.partial(host.sent, Transport.WS),
            timeout_s,
        )
        await stream.watch.run(stream.out)
    except WatchClosed as exc:
        code, reason = stream.ended(exc)
    except (ConnectionError, RuntimeError):  # the client went away, or was cut
        return _gone(stream)
    except Exception:  # never leave the reader waiting on a socket nobody closes
        log.exception("WebSocket writer of %s failed", stream.sid)
        code, reason = CloseCode.INTERNAL, "internal error"
    finally:
        stream.out = None
    if stream.stop is None:
        stream.stop = (code, reason)
    await _ws_close(host, ws, stream, code, reason)
    return code


async def _ws_close(
    host: StreamHost, ws: web.WebSocketResponse, stream: Stream, code: CloseCode, reason: str
) -> None:
    num, default = WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])
    message = (reason or default).encode()[:120]  # a close reason fits in 123 bytes
    with contextlib.suppress(ConnectionError, RuntimeError):
        # ws.close waits up to its own timeout (2 s) for the client's close frame
        await host.guarded(stream, ws.close(code=num, message=message), GOODBYE_S + 2.0)
