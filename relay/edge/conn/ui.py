"""A session's running turn in the Vercel AI SDK's UI message stream protocol.

``GET /v1/sessions/{sid}/ui-stream`` (and its alias ``GET /v1/chat/{sid}/stream``, the
URL the SDK's ``DefaultChatTransport({api: "/v1/chat"})`` reconnects to) answers:

- ``204`` when no turn of the session is generating (what ``useChat({resume: true})``
  expects when there is nothing to resume);
- otherwise an SSE stream (``x-vercel-ai-ui-message-stream: v1``) of the running turn
  **from its first frame** (the SDK's resume is a replay), as ``data:`` JSON parts:
  ``start`` (``messageId`` = ``<sid>-<turn>``), ``text-start``, ``text-delta`` per
  token frame, ``text-end``, ``finish`` (``finishReason``; the done frame's meta as
  ``messageMetadata``), or ``error`` (+ ``finish`` with ``finishReason: "error"``) for an
  error frame or frames lost for good; then ``data: [DONE]``.

Any relay serves any session (it reads the backlog and the live channel through the
hub, like the SSE and WebSocket streams), so many screens can resume the same turn.
Same token, refusals and drain as ``/events`` (docs/PROTOCOL.md).

Order of use: ``register(app, host)`` in :func:`relay.edge.http.server.make_app` (``host``:
the server, as a :class:`relay.edge.http.host.StreamHost`). Pure core:
:mod:`relay.protocol.uistream` (frames of one turn -> UI chunks), which the worker's AI
SDK chat POST (worker.gateway.aisdk) uses to answer with the same stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Final

from aiohttp import web
from multidict import istr
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import RelayError, WatchClosed
from relay.broker.rediscluster.errors import map_redis_errors
from relay.edge.conn.streams import Stream, Transport, discard
from relay.edge.http.host import StreamHost
from relay.protocol.codes import CloseCode, Refusal
from relay.protocol.frame import FrameError, decode
from relay.protocol.keys import log_key, meta_key
from relay.protocol.uistream import DONE, UiTurn, encode_chunk
from relay.protocol.uistream import UI_HEADERS as PROTOCOL_UI_HEADERS
from relay.service.errors import RETRY_AFTER, Reject

__all__ = ["UI_HEADERS", "active_turn", "register"]

log = logging.getLogger(__name__)

# istr names: see relay.edge.http.handlers.SSE_HEADERS
UI_HEADERS: Final = {istr(k): v for k, v in PROTOCOL_UI_HEADERS.items()}
_SCAN: Final = 256  # backlog entries per round trip when looking for a turn's start


async def active_turn(redis: RedisCluster, sid: str) -> tuple[int, int] | None:
    """The turn that is generating and the offset right before its first frame, or
    None. Reads the session's ``open`` marker, then walks the backlog back from its
    end to the turn's first frame (a reply is a few hundred frames: one or two trips)."""
    with map_redis_errors():
        opened, offset = await redis.hmget(meta_key(sid), ["open", "offset"])
        if not opened:
            return None
        turn, after = int(opened), int(offset or 0)
        top = "+"
        while True:
            entries: list[Any] = (
                await redis.xrevrange(log_key(sid), max=top, min="-", count=_SCAN) or []
            )
            for _id, fields in entries:
                try:
                    frame = decode(fields[b"f"])
                except (FrameError, KeyError, TypeError):
                    continue
                if frame.turn != turn:  # an older turn, or a gap (turn 0): stop there
                    return turn, frame.offset
                after = frame.offset - 1
            if len(entries) < _SCAN or after <= 0:
                return turn, max(after, 0)
            top = f"{after}-1"  # entry ids are "<offset>-1": continue below the oldest read


async def ui_stream_handler(host: StreamHost, request: web.Request) -> web.StreamResponse:
    try:
        sid = host.session(request)
        access = host.authorize(request, sid)
        host.check_capacity()
    except Reject as r:
        return host.refuse(r)
    assert host.redis is not None
    try:
        found = await active_turn(host.redis, sid)
    except RelayError as exc:
        log.warning("ui-stream of %s: backlog read failed: %r", sid, exc)  # not to clients
        return web.json_response(
            {"error": Refusal.UNAVAILABLE, "reason": "cannot read the session"},
            status=503,
            headers=RETRY_AFTER,
        )
    if found is None:
        return web.Response(status=204)
    turn, after = found
    try:
        stream = await host.open_stream(Transport.UI, sid, after, access)
    except Reject as r:
        return host.refuse(r)
    code = CloseCode.CLOSED
    ui = UiTurn(sid, turn)
    try:
        resp = web.StreamResponse(headers=UI_HEADERS)
        await resp.prepare(request)
        stream.sock = request.transport
        code = await _pump(host, resp, stream, ui)
        return resp
    except asyncio.CancelledError:
        code = CloseCode.CLIENT_GONE
        raise
    finally:
        await host.close_stream(stream, code)


async def _pump(
    host: StreamHost, resp: web.StreamResponse, stream: Stream, ui: UiTurn
) -> CloseCode:
    """Frames of the watch -> UI chunks on the socket until the turn ends; each write is
    bounded like the SSE stream's (a client that does not read is cut)."""
    cfg = host.config

    async def put(data: bytes) -> None:
        await host.guarded(stream, resp.write(data), cfg.write_timeout_s)

    nxt: asyncio.Task[Any] = asyncio.ensure_future(stream.watch.next())
    try:
        while not ui.finished:
            done, _ = await asyncio.wait((nxt,), timeout=cfg.heartbeat_s)
            if not done:
                await put(b": heartbeat\n\n")
                continue
            batch = nxt.result()
            nxt = asyncio.ensure_future(stream.watch.next())
            out = bytearray()
            for d in batch:
                try:
                    frame = decode(d.data)
                except FrameError:
                    continue
                for chunk in ui.feed(frame):
                    out += encode_chunk(chunk)
            if out:
                await put(bytes(out))
        await put(DONE)
        await resp.write_eof()
        return CloseCode.CLOSED
    except WatchClosed as exc:  # drain or slow consumer: the client resumes (a replay)
        return stream.ended(exc)[0]
    except (ConnectionError, RuntimeError):
        return stream.gone()
    finally:
        discard(nxt)


def register(app: web.Application, host: StreamHost) -> None:
    """The UI stream's routes, served by ``host`` (the app's edge server)."""
    handler = functools.partial(ui_stream_handler, host)
    app.router.add_get("/v1/sessions/{sid:[^/]+}/ui-stream", handler)
    app.router.add_get("/v1/chat/{sid:[^/]+}/stream", handler)
    app.router.add_route("OPTIONS", "/v1/sessions/{sid:[^/]+}/ui-stream", host.preflight)
    app.router.add_route("OPTIONS", "/v1/chat/{sid:[^/]+}/stream", host.preflight)
