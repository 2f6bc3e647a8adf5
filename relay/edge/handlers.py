"""The SSE and WebSocket stream handlers of the edge server.

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence (the server's one timer), a
  ``: close <code> <reason>`` comment last. Resume: ``Last-Event-ID`` header or
  ``last_event_id`` query, and ``gen`` (the generation the offset belongs to).
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``
  and ``gen``.
  The handler answers the upgrade and returns: the socket is then read, written and
  closed by a :class:`relay.edge.wsconn.WsConn` (frames from the hub's reader; a task
  only to drain a pushed-back socket or to close the stream). Pings and the dead-peer
  cutoff: the server's one stream timer (:mod:`relay.edge.beats`).

Both are written against :class:`relay.edge.host.StreamHost` (the server's interface to
its handlers). Order of use: :func:`relay.edge.server.make_app` routes the two paths to
:func:`sse_handler` and :func:`ws_handler` with its server as the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiohttp import hdrs, web
from multidict import istr

from relay.edge.host import StreamHost
from relay.edge.streams import (
    GOODBYE_S,
    Reject,
    SocketOut,
    Stream,
    Transport,
    jitter,
    query_value,
    sse_bytes,
)
from relay.edge.wsconn import WsConn, detach, upgrade
from relay.protocol import frame, sse
from relay.protocol.codes import CloseCode, Refusal
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
    """Check the request, answer the upgrade, hand the socket to a :class:`WsConn` and
    return: the stream goes on without this task (:mod:`relay.edge.wsconn`)."""
    cfg = host.config
    try:
        sid = host.session(request)
        access = host.authorize(request, sid)
        offset = parse_offset(lambda: sse.parse_offset(query_value(request, "from"), name="from"))
        gen = parse_gen(request)
        if not web.WebSocketResponse().can_prepare(request).ok:
            raise Reject(400, Refusal.NOT_WEBSOCKET, "this endpoint needs a WebSocket upgrade")
        stream = await host.open_stream(Transport.WS, sid, offset, access, gen)
    except Reject as r:
        return host.refuse(r)
    try:
        resp, transport = await upgrade(request)
        conn = WsConn(host, stream, transport, cfg.ws_max_message_bytes)
        detach(request, conn)
    except BaseException:  # the client went away (or the task was cancelled) mid-upgrade
        host.end_stream(stream, lost_code(stream, CloseCode.CLOSED))
        raise
    conn.start(host.hello(stream), cfg.write_timeout_s)
    return resp
