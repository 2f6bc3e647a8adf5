"""The stream handlers of the edge server: admit, answer the request, hand the socket on.

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence, a ``: close <code> <reason>``
  comment last. Resume: ``Last-Event-ID`` header or ``last_event_id`` query, and
  ``gen`` (the generation the offset belongs to); ``compact=1`` (every stream): a
  compacted join, each finished turn of the replay as at most three frames.
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``
  and ``gen``.

The fronts' streams (the AI SDK's UI stream, the Responses API's events:
:mod:`relay.fronts`) are answered the same way, with :func:`start_stream` and
:func:`stream_route`.

Every stream of a deleted session is refused with 410 ``session_deleted`` (the read the
open makes anyway finds the session's tombstone: :func:`relay.edge.http.server.deleted`).

Each handler checks the request, builds the transport's connection
(:class:`relay.edge.conn.sse.SseConn`, :class:`relay.edge.conn.ws.WsConn`), admits it
(:meth:`EdgeServer.admit`: limits, then the hub's subscription and replay), answers
the request through aiohttp (the response head and preamble, or the 101), hands the
socket to the connection (:func:`detach`) and returns: from then on the connection is
the socket's, and no task or aiohttp object is held while it is idle.

Order of use: :func:`relay.edge.http.app.make_app` routes the paths to these handlers
with its server as their first argument.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import hdrs, web
from multidict import istr

from relay.edge.conn.base import Conn, ws_text_frame
from relay.edge.conn.sse import SseConn
from relay.edge.conn.ws import WsConn, upgrade
from relay.edge.http.server import EdgeServer, query_value
from relay.protocol import frame, sse
from relay.protocol.codes import CloseCode, Refusal
from relay.service.errors import Reject
from relay.service.httpguard import detach_guard
from relay.service.register import Handler

__all__ = ["SSE_HEADERS", "detach", "handlers", "parse_compact", "parse_gen", "parse_offset",
           "sse_handler", "start_stream", "stream_route", "ws_handler"]  # fmt: skip

log = logging.getLogger(__name__)

WS_VERSION: Final = "13"  # the one WebSocket version (RFC 6455); aiohttp also takes 7 and 8

# Header names as multidict.istr: aiohttp's case-insensitive headers keep a lower-cased
# copy (and, once written, a title-cased one) of every plain str name, per response,
# for as long as the stream lasts; an istr carries its own (about 1.2 KB per stream).
SSE_HEADERS = {
    hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
    hdrs.CACHE_CONTROL: "no-cache",
    istr("X-Accel-Buffering"): "no",
}


def parse_offset(parse: Callable[[], int | None]) -> int | None:
    """The resume offset ``parse()`` reads from the request, or Reject 400 ``invalid_offset``."""
    try:
        return parse()
    except sse.OffsetError as exc:
        raise Reject(400, Refusal.INVALID_OFFSET, str(exc)) from None


def parse_gen(request: web.Request) -> str | None:
    """The ``gen`` query parameter (the client's generation), or Reject 400 ``invalid_gen``."""
    try:
        return frame.parse_gen(query_value(request, "gen"))
    except frame.GenError as exc:
        raise Reject(400, Refusal.INVALID_GEN, str(exc)) from None


_FLAGS: Final = {"": False, "0": False, "false": False, "1": True, "true": True}


def parse_compact(request: web.Request) -> bool:
    """The ``compact`` query parameter (a compacted join: every finished turn's token
    frames of the replay merged into one): ``1`` / ``true``, or ``0`` / ``false`` / absent;
    anything else is Reject 400 ``invalid_compact``."""
    raw = query_value(request, "compact")
    flag = _FLAGS.get(raw or "")
    if flag is None:
        raise Reject(400, Refusal.INVALID_COMPACT, "compact must be 1, true, 0 or false")
    return flag


def detach(request: web.Request, conn: asyncio.Protocol) -> asyncio.Transport:
    """Give the request's socket to ``conn`` and make aiohttp forget it: aiohttp's
    connection no longer has a transport (it writes nothing more to it and does not
    close it when the handler returns), and its ``connection_lost`` runs now, which
    drops the connection from aiohttp's server and frees its request and parser. The
    HTTP guard lets go of it too (:func:`relay.service.httpguard.detach_guard`): a
    stream has its own limits. Call it with no await between the response's last write
    and the handler's return."""
    handler = request.protocol
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    detach_guard(transport)
    transport.set_protocol(conn)
    handler.transport = None
    handler.connection_lost(None)
    return transport


async def start_stream(
    server: EdgeServer, conn: Conn, request: web.Request, resp: web.StreamResponse,
    preamble: bytes,
) -> web.StreamResponse:  # fmt: skip
    """Send the response head (with ``preamble``, if any), then give the socket to
    ``conn``; if the client went away meanwhile, the stream ends here."""
    try:
        writer = await resp.prepare(request)
        if preamble:  # the preamble sends the response head too
            await server.guarded(conn, resp.write(preamble))
        else:  # the head now: recent aiohttp keeps it until the first write
            send_headers = getattr(writer, "send_headers", None)
            if send_headers is not None:
                send_headers()
        conn.chunked = bool(getattr(writer, "chunked", False))
        conn.attach(detach(request, conn))  # no await since the head: aiohttp read no more
    except (ConnectionError, RuntimeError):  # the client went away, or was cut
        server.end_stream(conn, conn.gone())
    except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
        server.end_stream(conn, conn.gone())
        raise
    except Exception:
        server.end_stream(conn, CloseCode.INTERNAL)
        raise
    return resp


def stream_route(
    server: EdgeServer, handler: Callable[[EdgeServer, web.Request], Awaitable[web.StreamResponse]]
) -> dict[str, Handler]:
    """A stream's methods for the route table: its GET (``handler`` with ``server``
    first) and the cross-origin preflight. No HEAD: a stream's handler writes its body
    whatever the method, and a HEAD response has none (RFC 9110 9.3.2); a pooling proxy
    would hand those bytes to the next client. HEAD gets aiohttp's 405 (Allow:
    GET,OPTIONS), headers only."""
    return {"GET": functools.partial(handler, server), "OPTIONS": server.preflight}


async def sse_handler(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    """Check the request, send the response head and the preamble, hand the socket to
    an :class:`SseConn` and return: the stream goes on without this task."""
    cfg = server.config
    try:
        sid = server.session(request)
        access = server.authorize(request, sid)
        offset = parse_offset(
            lambda: sse.resume_offset(
                request.headers.get("Last-Event-ID"), query_value(request, "last_event_id")
            )
        )
        gen = parse_gen(request)
        compact = parse_compact(request)
        hub = server.check_capacity()
        conn = SseConn(hub, sid, offset, gen, retry_ms=cfg.retry_ms, compact=compact,
                       **server.conn_options(SseConn.transport_kind))  # fmt: skip
        await server.admit(conn, access)
    except Reject as r:
        return server.refuse(r)
    preamble = sse.preamble(cfg.retry_ms, server.hello(conn))
    return await start_stream(
        server, conn, request, web.StreamResponse(headers=SSE_HEADERS), preamble
    )


async def ws_handler(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    """Check the request, answer the upgrade, hand the socket to a :class:`WsConn` and
    return: the stream goes on without this task."""
    cfg = server.config
    try:
        sid = server.session(request)
        access = server.authorize(request, sid)
        offset = parse_offset(lambda: sse.parse_offset(query_value(request, "from"), name="from"))
        gen = parse_gen(request)
        compact = parse_compact(request)
        version = request.headers.get(hdrs.SEC_WEBSOCKET_VERSION)
        if version is not None and version.strip() != WS_VERSION:  # RFC 6455 4.4
            raise Reject(426, Refusal.UNSUPPORTED_WS_VERSION, "this relay speaks WebSocket "
                         "version 13 only", {hdrs.SEC_WEBSOCKET_VERSION: WS_VERSION})  # fmt: skip
        if not web.WebSocketResponse().can_prepare(request).ok:
            raise Reject(400, Refusal.NOT_WEBSOCKET, "this endpoint needs a WebSocket upgrade")
        hub = server.check_capacity()
        conn = WsConn(hub, sid, offset, gen, max_message=cfg.ws_max_message_bytes,
                      compact=compact, **server.conn_options(WsConn.transport_kind))  # fmt: skip
        await server.admit(conn, access)
    except Reject as r:
        return server.refuse(r)
    try:
        resp, _ = await upgrade(request)
        conn.attach(detach(request, conn), ws_text_frame(server.hello(conn)))
    except BaseException:  # the client went away mid-upgrade, or the task was cancelled
        server.end_stream(conn, conn.gone())
        raise
    return resp


def handlers(server: EdgeServer) -> dict[str, dict[str, Handler]]:
    """The own wire's streams by their name in the route table (relay/service/routes.py),
    as each front's ``handlers(server)`` gives its own: a new transport of the own wire is
    its connection class (relay/edge/conn/), its handler and its line here, and its row in
    the table."""
    return {
        "wire.sse": stream_route(server, sse_handler),
        "wire.ws": stream_route(server, ws_handler),
    }
