"""The AI SDK's UI message stream on the relay: its routes.

- ``GET /v1/sessions/{sid}/ui-stream`` (and ``GET /v1/chat/{sid}/stream``, the SDK's
  resume URL): the running turn in the AI SDK's UI message stream, from its first frame;
  204 when no turn is generating (the connection: :mod:`relay.fronts.aisdk.conn`).

Same token, refusals, limits and drain as the own wire's streams
(:mod:`relay.edge.http.handlers`). Order of use: :func:`handlers` in
:func:`relay.edge.http.app.make_app`, which registers them from the route table.
"""

from __future__ import annotations

import logging

from aiohttp import web

from relay.broker.errors import RelayError, SessionDeleted
from relay.edge.http.handlers import parse_compact, start_stream, stream_route
from relay.edge.http.server import EdgeServer, deleted
from relay.fronts.aisdk.conn import UI_HEADERS, UiConn
from relay.protocol.codes import Refusal
from relay.service.errors import RETRY_AFTER, Reject
from relay.service.register import Handler

__all__ = ["handlers", "ui_stream_handler"]

log = logging.getLogger(__name__)


def handlers(server: EdgeServer) -> dict[str, dict[str, Handler]]:
    """This front's routes of the table (relay/service/routes.py), name -> handler."""
    return {
        "aisdk.ui_stream": stream_route(server, ui_stream_handler),
        "aisdk.resume": stream_route(server, ui_stream_handler),  # the SDK's resume URL
    }


async def ui_stream_handler(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    """204 when no turn is generating; else the turn as the UI message stream, by a
    :class:`UiConn` once the response head is sent."""
    try:
        sid = server.session(request)
        access = server.authorize(request, sid)
        compact = parse_compact(request)
        hub = server.check_capacity()
    except Reject as r:
        return server.refuse(r)
    try:
        found = await hub.broker.active_turn(sid)
    except SessionDeleted:
        return server.refuse(deleted())
    except RelayError as exc:
        log.warning("ui-stream of %s: backlog read failed: %r", sid, exc)  # not to clients
        return server.refuse(Reject(503, Refusal.UNAVAILABLE, "cannot read the session",
                                    RETRY_AFTER))  # fmt: skip
    if found is None:
        return web.Response(status=204)
    turn, after = found
    try:
        conn = UiConn(hub, sid, turn, after, compact=compact,
                      **server.conn_options(UiConn.transport_kind))  # fmt: skip
        await server.admit(conn, access)
    except Reject as r:
        return server.refuse(r)
    resp = web.StreamResponse(headers=UI_HEADERS)
    resp.force_close()  # the Conn closes the socket after the turn's end: say so to pools
    return await start_stream(server, conn, request, resp, b"")
