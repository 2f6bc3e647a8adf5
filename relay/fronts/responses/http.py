"""OpenAI's Responses API on the relay: a response's event stream, resumable anywhere.

``GET /v1/responses/{id}?stream=true&starting_after=N``: the same events the worker's
``POST /v1/responses`` streams (the same translation,
:mod:`relay.fronts.responses.wire`), from the backlog and then live through the hub, so
any relay serves any response to any number of clients, and a client whose relay died
resumes on another after the last ``sequence_number`` it read, for as long as the
session's backlog holds the turn. Everything else of the API (create, the object,
cancel, delete, input items) is the worker's (:mod:`worker.fronts.responses.http`); a
request here without ``stream=true`` is a 400 that says so.

Auth: a gateway key (``--gateway-key``, the workers' keys), as the OpenAI SDK sends its
``api_key``; the response must belong to that key (its session's owner tag,
:func:`relay.service.apikeys.owns`): any other is a 404, as for an id that never
existed. Errors in OpenAI's shape: 400, 401, 404, 429 (stream limits), 503 (draining,
Redis).

Order of use: :func:`handlers` in :func:`relay.edge.http.app.make_app`, which registers
them from the route table.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from relay.broker.errors import RelayError, SessionDeleted
from relay.broker.port import ResponseReads
from relay.edge.http.handlers import SSE_HEADERS, start_stream, stream_route
from relay.edge.http.limits import Access
from relay.edge.http.server import EdgeServer
from relay.fronts.responses.conn import ResponsesConn
from relay.fronts.responses.wire import (
    OWNER,
    InvalidResponseId,
    ResponseId,
    parse_response_id,
)
from relay.protocol.codes import Refusal
from relay.protocol.frame import FrameError, decode
from relay.service.apikeys import caller, check_api_key, owns
from relay.service.errors import Reject, openai_refusal
from relay.service.register import Handler

__all__ = ["handlers", "responses_stream_handler"]

log = logging.getLogger(__name__)


def handlers(server: EdgeServer) -> dict[str, dict[str, Handler]]:
    """This front's routes of the table (relay/service/routes.py), name -> handler."""
    return {"responses.stream": stream_route(server, responses_stream_handler)}  # ?stream=true


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error"}  # fmt: skip


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, headers: Any = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


def _answer(server: EdgeServer, r: _Refused) -> web.Response:
    server.metrics.rejected.labels(r.code).inc()
    kind = _KINDS.get(r.status, "api_error")
    return openai_refusal(r.status, r.message, kind=kind, code=r.code, headers=r.headers)


def _check(server: EdgeServer, request: web.Request) -> tuple[ResponseId, int, str]:
    """The response, the offset to resume after and who asks (the kit's
    :func:`relay.service.apikeys.caller`), or :class:`_Refused`."""
    header = request.headers.get("Authorization")
    if server.config.auth_enabled:
        code = check_api_key(server.config.gateway_keys, header)
        if code is Refusal.GATEWAY_DISABLED:
            raise _Refused(401, "this relay takes no gateway key: start it with --gateway-key",
                           code)  # fmt: skip
        if code is not None:
            raise _Refused(401, "send 'Authorization: Bearer <gateway key>'", code)
    raw = request.match_info["rid"]
    try:
        rid = parse_response_id(raw)
    except InvalidResponseId as exc:
        raise _Refused(404, str(exc), "response_not_found") from None
    if request.query.get("stream", "").lower() not in ("true", "1"):
        raise _Refused(400, "a relay serves a response's event stream (?stream=true); GET "
                       "the object from a worker", "stream_required")  # fmt: skip
    after = request.query.get("starting_after") or "-1"
    if after != "-1" and (not after.isdigit() or int(after) > 2**53):
        raise _Refused(400, "'starting_after' must be a non-negative integer",
                       "invalid_starting_after")  # fmt: skip
    return rid, int(after), caller(header, auth=server.config.auth_enabled)


async def _exists(broker: ResponseReads, rid: ResponseId, who: str) -> bool:
    """The session is alive and the Responses API's, made by ``who``, and the id's first
    offset is its turn's ``meta`` frame (one read: the session's keys share a slot)."""
    try:
        owner, data = await broker.response_head(rid.session, rid.first)
    except SessionDeleted:
        return False
    if data is None or not owns(owner, OWNER, who, rid.session):
        return False
    try:
        frame = decode(data)
    except FrameError:
        return False
    return frame.kind == "meta" and frame.turn == rid.turn


async def responses_stream_handler(server: EdgeServer, request: web.Request) -> web.StreamResponse:
    """Check the request and the response's existence, then hand the socket to a
    :class:`ResponsesConn` (the replay from the response's first frame, then live)."""
    try:
        rid, after, who = _check(server, request)
        hub = server.check_capacity()
        broker = hub.broker
        if not isinstance(broker, ResponseReads):
            raise _Refused(503, "this relay has no Redis backlog", "unavailable")
        try:
            found = await _exists(broker, rid, who)
        except RelayError as exc:
            log.warning("responses of %s: read failed: %r", rid.session, exc)
            raise _Refused(503, "cannot read the response; retry", "unavailable",
                           {"Retry-After": "1"}) from None  # fmt: skip
        if not found:
            raise _Refused(404, f"no response with id {str(rid)[:80]!r} here (its events "
                           "may have left the backlog)", "response_not_found")  # fmt: skip
        access = Access(None, 0, server.address(request))
        conn = ResponsesConn(hub, rid, after, **server.conn_options(ResponsesConn.transport_kind))
        await server.admit(conn, access)
    except _Refused as r:
        return _answer(server, r)
    except Reject as r:
        return _answer(server, _Refused(r.status, r.reason, str(r.error), r.headers))
    resp = web.StreamResponse(headers=SSE_HEADERS)
    # the response ends with the socket (the Conn closes it after the last event): say so,
    # or a client that pools connections sends its next request on one about to close
    resp.force_close()
    return await start_stream(server, conn, request, resp, b"")
