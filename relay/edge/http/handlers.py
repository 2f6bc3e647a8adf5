"""The SSE and WebSocket stream handlers of the edge server.

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence (the server's one timer), a
  ``: close <code> <reason>`` comment last. Resume: ``Last-Event-ID`` header or
  ``last_event_id`` query, and ``gen`` (the generation the offset belongs to).
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``
  and ``gen``.

Each handler answers its request (SSE: the response head and the preamble; WebSocket:
the 101) and returns: the socket is then the relay's own, written, read and closed by
an :class:`relay.edge.conn.sse.SseConn` or a :class:`relay.edge.conn.ws.WsConn`
(:mod:`relay.edge.conn.detached`: frames from the hub's reader, a task only to drain a
pushed-back socket or to end the stream, no task while it is idle). Heartbeats, pings
and the dead-peer cutoff: the server's one stream timer (:mod:`relay.edge.conn.beats`).

Both are written against :class:`relay.edge.http.host.StreamHost` (the server's interface to
its handlers). Order of use: :func:`relay.edge.http.server.make_app` routes the two paths to
:func:`sse_handler` and :func:`ws_handler` with its server as the host.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import hdrs, web
from multidict import istr

from relay.edge.conn.detached import detach
from relay.edge.conn.sse import SseConn
from relay.edge.conn.streams import (
    Transport,
    query_value,
    sse_bytes,
    ws_bytes,
    ws_text_frame,
)
from relay.edge.conn.ws import WsConn, upgrade
from relay.edge.http.host import StreamHost
from relay.protocol import frame, sse
from relay.protocol.codes import CloseCode, Refusal
from relay.service.errors import Reject

__all__ = ["parse_gen", "parse_offset", "sse_handler", "ws_handler"]

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


# -- SSE ---------------------------------------------------------------------------------


async def sse_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    """Check the request, send the response head and the preamble, hand the socket to
    an :class:`SseConn` and return: the stream goes on without this task
    (:mod:`relay.edge.conn.sse`)."""
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
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        writer = await resp.prepare(request)
        transport = request.transport
        assert writer is not None
        if transport is None:
            raise ConnectionResetError("the client went away")
        stream.sock = transport
        await host.guarded(  # the preamble sends the response head too
            stream, resp.write(sse.preamble(cfg.retry_ms, host.hello(stream))), cfg.write_timeout_s
        )
        chunked = bool(getattr(writer, "chunked", False))
        conn = SseConn(host, stream, transport, chunked=chunked, retry_ms=cfg.retry_ms)
        detach(request, conn)  # no await since the preamble: aiohttp read nothing more
    except (ConnectionError, RuntimeError):  # the client went away, or was cut
        host.end_stream(stream, stream.gone())
        return resp
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        host.end_stream(stream, stream.gone())
        raise
    except Exception:
        host.end_stream(stream, CloseCode.INTERNAL)
        raise
    conn.start(b"", sse_bytes, host.sender(Transport.SSE), cfg.write_timeout_s)
    return resp


# -- WebSocket ---------------------------------------------------------------------------


async def ws_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    """Check the request, answer the upgrade, hand the socket to a :class:`WsConn` and
    return: the stream goes on without this task (:mod:`relay.edge.conn.ws`)."""
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
    except BaseException:  # the client went away mid-upgrade, or the task was cancelled
        host.end_stream(stream, stream.gone())
        raise
    conn.start(
        ws_text_frame(host.hello(stream)), ws_bytes, host.sender(Transport.WS), cfg.write_timeout_s
    )
    return resp
