"""The SSE and WebSocket stream handlers of the edge server.

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence (the server's one timer), a
  ``: close <code> <reason>`` comment last. Resume: ``Last-Event-ID`` header or
  ``last_event_id`` query, and ``gen`` (the generation the offset belongs to).
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``
  and ``gen``.
  The handler task reads the client (aiohttp requires it); frames are written from
  the hub's reader, and a writer task runs only to drain a pushed-back socket or to
  close the stream. Pings and the dead-peer cutoff: the server's one stream timer
  (:mod:`relay.edge.beats`).

Both are written against :class:`relay.edge.host.StreamHost` (the server's interface to
its handlers). Order of use: :func:`relay.edge.server.make_app` routes the two paths to
:func:`sse_handler` and :func:`ws_handler` with its server as the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiohttp import WSMsgType, hdrs, web
from multidict import istr

from relay.edge.host import StreamHost
from relay.edge.streams import (
    GOODBYE_S,
    WS_CLOSE,
    Reject,
    SocketOut,
    Stream,
    Transport,
    client_reason,
    is_ping,
    jitter,
    query_value,
    sse_bytes,
    ws_bytes,
)
from relay.protocol import frame, sse
from relay.protocol.codes import CloseCode, Refusal, WsClose
from relay.redisio.errors import WatchClosed

__all__ = ["idle_timer_off", "lost_code", "parse_gen", "parse_offset", "sse_handler", "ws_handler"]

log = logging.getLogger(__name__)

# Header names as multidict.istr: aiohttp's case-insensitive headers keep a lower-cased
# copy (and, once written, a title-cased one) of every plain str name, per response,
# for as long as the stream lasts; an istr carries its own (about 1.2 KB per stream).
SSE_HEADERS = {
    hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
    hdrs.CACHE_CONTROL: "no-cache",
    istr("X-Accel-Buffering"): "no",
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
        return frame.parse_gen(query_value(request, "gen"))
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
    try:
        sid = host.session(request)
        access = host.authorize(request, sid)
        offset = parse_offset(
            lambda: sse.resume_offset(
                request.headers.get("Last-Event-ID"), query_value(request, "last_event_id")
            )
        )
        gen = parse_gen(request)
        stream = await host.open_stream(Transport.SSE, sid, offset, access, gen)
    except Reject as r:
        return host.refuse(r)
    cfg = host.config
    code = CloseCode.CLOSED
    try:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        writer = await resp.prepare(request)
        stream.sock = request.transport
        assert writer is not None
        assert stream.sock is not None
        idle_timer_off(request)
        # One coroutine from here on (no helper coroutines, no closures): an idle
        # stream's frames are what it holds.
        try:
            await host.guarded(  # the preamble sends the response head too
                stream,
                resp.write(sse.preamble(cfg.retry_ms, host.hello(stream))),
                cfg.write_timeout_s,
            )
            stream.out = SocketOut(
                stream,
                stream.sock,
                writer,
                sse_bytes,
                host.sender(Transport.SSE),
                cfg.write_timeout_s,
            )
            await stream.watch.run(stream.out)
        except WatchClosed as exc:
            ended, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            code = _gone(stream)
            return resp
        finally:
            stream.out = None
        retry = jitter(cfg.retry_ms) if ended is CloseCode.RELAY_SHUTDOWN else cfg.retry_ms
        with contextlib.suppress(ConnectionError, RuntimeError):
            goodbye = sse.goodbye(ended, reason, retry)
            await host.guarded(stream, resp.write(goodbye), GOODBYE_S)
            await host.guarded(stream, resp.write_eof(), GOODBYE_S)
        code = ended
        return resp
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        code = lost_code(stream, code)
        raise
    except Exception:
        code = CloseCode.INTERNAL
        raise
    finally:
        await host.close_stream(stream, code)


def idle_timer_off(request: web.Request) -> None:
    """Cancel aiohttp's idle-connection timer of this connection (armed when it opened,
    for an hour by default): a stream never needs it, and every idle stream would hold
    one. aiohttp arms it again once the response ends, if the connection stays open."""
    request.protocol.keep_alive(True)


# -- WebSocket ---------------------------------------------------------------------------


async def ws_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    cfg = host.config
    try:
        sid = host.session(request)
        access = host.authorize(request, sid)
        offset = parse_offset(lambda: sse.parse_offset(query_value(request, "from"), name="from"))
        gen = parse_gen(request)
        ws = web.WebSocketResponse(
            heartbeat=None,  # the server's one timer pings (EdgeServer.beat_ws), not one each
            autoping=False,  # so that _ws_reader sees the pongs (and answers the pings)
            max_msg_size=cfg.ws_max_message_bytes,
            compress=False,
            timeout=2.0,
        )
        if not ws.can_prepare(request).ok:
            raise Reject(400, Refusal.NOT_WEBSOCKET, "this endpoint needs a WebSocket upgrade")
        stream = await host.open_stream(Transport.WS, sid, offset, access, gen)
    except Reject as r:
        return host.refuse(r)
    code = CloseCode.CLOSED
    writer = _WsWriter(host, ws, stream)
    try:
        pw = await ws.prepare(request)
        stream.sock = request.transport
        assert stream.sock is not None
        idle_timer_off(request)
        timeout_s = cfg.write_timeout_s
        try:
            await host.guarded(stream, ws.send_frame(host.hello(stream), WSMsgType.TEXT), timeout_s)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            code = _gone(stream)
            return ws
        stream.out = SocketOut(
            stream, stream.sock, pw, ws_bytes, host.sender(Transport.WS), timeout_s
        )
        stream.watch.attach(stream.out, writer.wake)
        # This task reads the client (aiohttp requires it). Frames are written from the
        # hub's reader; a writer task runs only while a pushed-back socket has frames
        # queued, and to end the stream: an idle stream holds no second task.
        seen = await _ws_reader(ws, stream)
        if seen is None:  # the writer ended the stream and closed the socket
            ended = await writer.finished()
            code = ended if ended is not None else _gone(stream)
        else:
            code = seen
            writer.stop()
            if code is not CloseCode.CLIENT_GONE:  # the client broke the protocol: we close
                await _ws_close(host, ws, stream, code, client_reason(code))
            await writer.finished()
        return ws
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        code = lost_code(stream, code)
        raise
    finally:
        writer.stop()
        stream.out = None
        await host.close_stream(stream, code)


async def _ws_reader(ws: web.WebSocketResponse, stream: Stream) -> CloseCode | None:
    """Read the client's messages in the handler task (aiohttp requires it). None: the
    socket closed because the writer ended the stream; else why the client's side ended."""
    loop = asyncio.get_running_loop()
    stream.heard_at = loop.time()
    while True:
        msg = await ws.receive()
        stream.heard_at, stream.pinged_at = loop.time(), 0.0  # the client is alive
        if msg.type is WSMsgType.TEXT:
            if not is_ping(msg.data):
                return CloseCode.BAD_MESSAGE
        elif msg.type is WSMsgType.PING:  # what aiohttp's autoping did
            await ws.pong(msg.data)
        elif msg.type is WSMsgType.PONG:
            pass
        elif msg.type is WSMsgType.BINARY:
            return CloseCode.BINARY
        elif msg.type is WSMsgType.ERROR:  # aiohttp already closed (1009 for too big)
            if ws.close_code == WsClose.MESSAGE_TOO_BIG:
                return CloseCode.TOO_BIG
            return CloseCode.CLIENT_GONE
        elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            return None if stream.stop is not None else CloseCode.CLIENT_GONE


class _WsWriter:
    """The writer task of one WebSocket stream, started by the stream's tap only when it
    is needed (:meth:`relay.edge.tap.Tap.attach`): to drain what a pushed-back socket
    has queued (the task ends once the queue is empty), or to close the stream with the
    reason its watch closed."""

    __slots__ = ("_host", "_stopped", "_stream", "_task", "_ws")

    def __init__(self, host: StreamHost, ws: web.WebSocketResponse, stream: Stream) -> None:
        self._host, self._ws, self._stream = host, ws, stream
        self._task: asyncio.Task[CloseCode | None] | None = None
        self._stopped = False

    def wake(self) -> None:
        if self._stopped or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.create_task(self._run(), name=f"ws-writer:{self._stream.sid}")

    def stop(self) -> None:
        """No writer from now on (the handler ends the stream itself)."""
        self._stopped = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def finished(self) -> CloseCode | None:
        """The code the last writer ended the stream with, once it is done (None: none did)."""
        task = self._task
        if task is None:
            return None
        await asyncio.wait([task])
        return None if task.cancelled() else task.result()

    async def _run(self) -> CloseCode | None:
        stream = self._stream
        try:
            await stream.watch.drain()
            return None
        except WatchClosed as exc:
            code, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            return _gone(stream)
        except Exception:  # never leave the reader waiting on a socket nobody closes
            log.exception("WebSocket writer of %s failed", stream.sid)
            code, reason = CloseCode.INTERNAL, "internal error"
        if stream.stop is None:
            stream.stop = (code, reason)
        await _ws_close(self._host, self._ws, stream, code, reason)
        return code


async def _ws_close(
    host: StreamHost, ws: web.WebSocketResponse, stream: Stream, code: CloseCode, reason: str
) -> None:
    num, default = WS_CLOSE.get(code, WS_CLOSE[CloseCode.INTERNAL])
    message = (reason or default).encode()[:120]  # a close reason fits in 123 bytes
    with contextlib.suppress(ConnectionError, RuntimeError):
        # ws.close waits up to its own timeout (2 s) for the client's close frame
        await host.guarded(stream, ws.close(code=num, message=message), GOODBYE_S + 2.0)
