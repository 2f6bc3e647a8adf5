"""The Durable Streams routes of a relay: ``PUT``, ``POST``, ``GET``, ``HEAD`` and
``DELETE /v1/stream/{path}`` (one resource, every method, so that no method meets
aiohttp's 405 of another route), and ``GET /v1/sessions/{sid}/stream`` (a chat session
read as a JSON-mode stream, :mod:`relay.durable.sessions`).

Every request is checked whole (headers, offset, body) before Redis is touched: a
refused request writes nothing. Writes: :mod:`relay.durable.store`; reads:
:mod:`relay.durable.reads`.

Order of use: ``handlers(Durable(server))`` in :func:`relay.edge.http.app.make_app`, which
registers them on the table's routes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

from aiohttp import web

from relay.broker.errors import RedisUnavailable, RelayError, SessionDeleted
from relay.broker.port import StreamsBroker, StreamStore
from relay.durable import bodies, core, fork, quota, reads, store
from relay.durable.auth import Gate, Grant, Refused, token_subject
from relay.durable.core import BadRequest, format_offset
from relay.durable.live import Waker
from relay.durable.sessions import SessionSource
from relay.edge.fanout.presence import viewing
from relay.protocol.auth import Scope
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service.budget import ByteBudgets
from relay.service.errors import text_refusal
from relay.service.httpbody import read_body
from relay.service.jsonbody import BodyRefused

if TYPE_CHECKING:
    from relay.edge.fanout.hub import Hub
    from relay.edge.http.server import EdgeServer

__all__ = ["Durable", "handlers"]

log = logging.getLogger(__name__)
_PROTOCOL_HEADERS: Final = (
    "Stream-Next-Offset, Stream-Up-To-Date, Stream-Closed, Stream-Cursor, Stream-TTL, "
    "Stream-Expires-At, Stream-SSE-Data-Encoding, Producer-Epoch, Producer-Seq, "
    "Producer-Expected-Seq, Producer-Received-Seq, ETag, Location, X-Relay-Id"
)
# a token of a fork's source (bare), when the request's own token is the fork's
FORK_TOKEN: Final = "Stream-Forked-From-Token"
# section 12.7 (browser security headers) and the protocol's headers readable by a page
SECURITY: Final = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
    "Access-Control-Expose-Headers": _PROTOCOL_HEADERS,
}
PREFLIGHT: Final = {
    "Access-Control-Allow-Methods": "GET, HEAD, PUT, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": (
        "Authorization, Content-Type, If-None-Match, Stream-TTL, Stream-Expires-At, "
        "Stream-Closed, Stream-Seq, Producer-Id, Producer-Epoch, Producer-Seq, "
        "Stream-Forked-From, Stream-Fork-Offset, Stream-Fork-Sub-Offset, "
        f"{FORK_TOKEN}"
    ),
    "Access-Control-Max-Age": "600",
}


class Durable:
    """The routes' state: the server (its Redis client, broker and config), the gate,
    the waker (the hub's tap, set when the hub starts)."""

    def __init__(self, server: EdgeServer) -> None:
        cfg = server.config
        self.server, self.config = server, cfg
        self.gate = Gate(
            server.keys, cfg.durable_open_prefix, max_lifetime_s=cfg.session_ttl_s,
            per_token=cfg.max_streams_per_token, per_address=cfg.max_streams_per_address,
        )  # fmt: skip
        self.waker = Waker(self)
        self.quota = quota.Quota(cfg.durable_max_stream_bytes, ByteBudgets(
            per_token=cfg.durable_token_bytes, per_address=cfg.durable_address_bytes,
            window_s=cfg.durable_budget_window_s))  # fmt: skip
        server.broker_tap = self.waker.on_message  # set on the hub it makes
        self.parser = bodies.Parser()  # large JSON bodies, parsed off the loop

    async def cleanup(self, _app: web.Application) -> None:
        """The app's cleanup: the body parser's process stops."""
        self.parser.close()

    def hub(self) -> Hub:
        """The relay's hub, once its store is reached (and able to hold streams)."""
        hub = self.server.hub
        if hub is None or not isinstance(hub.broker, StreamsBroker):
            raise Refused(503, "not connected to Redis yet: try again or another relay")
        return hub

    def _broker(self) -> StreamsBroker:
        broker = self.hub().broker
        assert isinstance(broker, StreamsBroker)  # hub() checked it
        return broker

    async def tap_subscribe(self, channel: str) -> None:
        await self._broker().tap_subscribe(channel)

    def tap_unsubscribe(self, channel: str) -> None:
        hub = self.server.hub
        if hub is not None and isinstance(hub.broker, StreamsBroker):
            hub.broker.tap_unsubscribe(channel)

    def ready(self) -> tuple[StreamsBroker, Waker]:
        """The broker (the session reads, its ``streams``) and the waker; refused while
        draining or before the store is reached."""
        if self.server.draining:
            raise Refused(503, "draining: try another relay")
        return self._broker(), self.waker

    def options(self, public: bool, address: str) -> reads.ReadOptions:
        """How a read is served; its bytes in memory under the hub's replay budget, an
        address's catch-up reads within its share."""
        c = self.config
        return reads.ReadOptions(
            c.durable_long_poll_s, c.durable_sse_close_s, public, budget=self.hub().budget,
            reserve=max(reads.CHUNK_BYTES, c.durable_max_body_bytes),
            write_timeout_s=c.write_timeout_s, headers=SECURITY, key=address,
        )  # fmt: skip

    async def body(self, request: web.Request) -> bytes:
        """The body (any media type: a stream has its own), bounded by
        ``--durable-max-body-bytes``; refused as plain text, the protocol's way."""
        try:
            return await read_body(request, self.config.durable_max_body_bytes, content_type=None)
        except BodyRefused as r:
            hint = " (--durable-max-body-bytes)" if r.status == 413 else ""
            raise Refused(r.status, r.reason + hint) from None


_error = text_refusal  # a refusal: its reason as the body, the protocol's way


async def _guarded(request: web.Request, durable: Durable, path: str | None) -> web.StreamResponse:
    resp: web.StreamResponse
    try:
        if request.method == "OPTIONS":
            resp = web.Response(status=204, headers=PREFLIGHT)
        elif path is None:
            resp = await _session(request, durable)
        else:
            resp = await _stream(request, durable, path)
    except BadRequest as exc:
        resp = _error(exc.status, str(exc))
    except Refused as exc:
        resp = _error(exc.status, exc.reason, exc.headers)
    except store.SoftDeleted:
        resp = _error(410, "the stream is deleted (its forks still hold its data)")
    except web.HTTPException as exc:
        resp = _error(exc.status, exc.text or exc.reason)
    except SessionDeleted:  # a live read's viewer found the tombstone
        resp = _error(404, "no such stream")
    except RedisUnavailable as exc:  # the detail (a node, a timeout) goes to the log only
        log.warning("durable %s %s: %s", request.method, request.path, exc)
        resp = _error(503, "Redis did not answer: try again", {"Retry-After": "1"})
    except RelayError as exc:  # a reply we did not expect: ours to fix, never the client's
        log.error("durable %s %s: %s: %s", request.method, request.path, type(exc).__name__, exc)
        resp = _error(500, "the store refused this operation; the relay logged why")
    if not resp.prepared:
        resp.headers.update(SECURITY)
    return resp


async def _stream(request: web.Request, durable: Durable, path: str) -> web.StreamResponse:
    ref = store.StreamRef.of(path)  # BadRequest for a malformed path
    method = request.method
    need: Scope = "watch" if method in ("GET", "HEAD") else "write"
    address = durable.server.address(request)
    grant = durable.gate.check(request, token_subject(path), need, address, path=path)
    if method == "PUT" and "Stream-Forked-From" in request.headers:
        _may_read_source(request, durable, address)
    if method == "PUT":
        return await _put(request, durable, ref, grant)
    if method == "POST":
        return await _post(request, durable, ref, grant)
    if method == "DELETE":
        broker, _ = durable.ready()
        code = await store.delete(broker.streams, ref)
        if code == 404:
            return _error(404, "no such stream")
        if code == 410:
            return _error(410, "the stream is deleted (its forks still hold its data)")
        return web.Response(status=204)
    if method == "HEAD":
        broker, _ = durable.ready()
        view = await store.read(broker.streams, ref, None, count=0, touch=False)
        if view is None:
            return web.Response(status=404)
        h = {"Content-Type": view.content_type, "Stream-Next-Offset": format_offset(view.next),
             "Cache-Control": "no-store"}  # fmt: skip
        if view.ttl is not None:
            h["Stream-TTL"] = str(view.ttl)
        if view.expires_at:
            h["Stream-Expires-At"] = view.expires_at
        if view.closed:
            h["Stream-Closed"] = "true"
        return web.Response(status=200, headers=h)
    if method == "GET":
        broker, waker = durable.ready()
        source = _StreamSource(broker.streams, ref)
        with durable.gate.live(grant):  # every read counts, a catch-up's too
            return await reads.get(
                request, source, waker, durable.options(grant.public, grant.address)
            )
    return _error(
        405, f"{method} is not a Durable Streams method", {"Allow": "GET, HEAD, PUT, POST, DELETE"}
    )


def _may_read_source(request: web.Request, durable: Durable, address: str) -> None:
    """A fork reads its source: a token that reads it (``Stream-Forked-From-Token``, else
    the request's own), unless the source is under the open prefix."""
    src = fork.source_path(request.headers["Stream-Forked-From"])
    header = FORK_TOKEN if FORK_TOKEN in request.headers else None
    try:
        durable.gate.check(request, token_subject(src), "watch", address, path=src, header=header)
    except Refused as exc:
        hint = "" if header else f" (send a token of the source in {FORK_TOKEN})"
        raise Refused(exc.status, f"the fork's source: {exc.reason}{hint}", exc.headers) from None


class _StreamSource:
    def __init__(self, streams: StreamStore, ref: store.StreamRef) -> None:
        self.streams, self.ref, self.channel = streams, ref, ref.channel

    async def read(self, start: int | None, count: int) -> store.View | None:
        return await store.read(
            self.streams, self.ref, start, count=count, max_bytes=reads.CHUNK_BYTES
        )


def _write_headers(request: web.Request, op: str) -> store.Write:
    h = request.headers
    ttl = core.parse_ttl(h.get("Stream-TTL"))
    expires = core.parse_expires_at(h.get("Stream-Expires-At"))
    if ttl is not None and expires is not None:
        raise BadRequest("Stream-TTL and Stream-Expires-At: send one")
    ct = h.get("Content-Type")
    if op == "put" and not ct:
        ct = "application/octet-stream"
    if "Stream-Forked-From" not in h and (
        "Stream-Fork-Offset" in h or "Stream-Fork-Sub-Offset" in h
    ):
        raise BadRequest("Stream-Fork-Offset / -Sub-Offset need Stream-Forked-From")
    seq = h.get("Stream-Seq")
    if seq is not None and not seq:
        raise BadRequest("Stream-Seq must not be empty")
    return store.Write(
        op="put" if op == "put" else "post", media_type=core.media_type(ct),
        content_type=ct or "", ttl=ttl, expires_at=expires,
        close=core.is_true(h.get("Stream-Closed")), stream_seq=seq,
        producer=core.parse_producer(
            h.get("Producer-Id"), h.get("Producer-Epoch"), h.get("Producer-Seq")
        ),
    )  # fmt: skip


async def _put(
    request: web.Request, durable: Durable, ref: store.StreamRef, grant: Grant
) -> web.Response:
    w = _write_headers(request, "put")
    body = await durable.body(request)
    streams = durable.ready()[0].streams
    source = None
    if "Stream-Forked-From" in request.headers:
        json_body = core.media_type(request.headers.get("Content-Type")) == "application/json"
        own = await durable.parser.messages(body, json_body, allow_empty_array=True)
        plan = await fork.plan(streams, w, request.headers, own)
        w, source = plan.write, plan.source

        async def write(step: store.Write, msgs: list[bytes]) -> store.WriteResult:
            return await quota.write(durable.quota, streams, ref, step, msgs, grant)

        r = await fork.create(streams, ref, plan, write)  # its copy under the byte bounds
    else:
        json_mode = w.media_type == "application/json"
        msgs = await durable.parser.messages(body, json_mode, allow_empty_array=True)
        r = await quota.write(durable.quota, streams, ref, w, msgs, grant)
        if r.code == 409 and await store.prune(streams, ref):  # forks that expired
            r = await quota.write(durable.quota, streams, ref, w, msgs, grant)  # path freed?
    if r.code == 201 and source is not None and not await store.fork_ref(streams, source, ref.path):
        await store.delete(streams, ref)  # the source went meanwhile: no orphan fork
        return _error(409, "the source stream was deleted meanwhile")
    h = {"Content-Type": w.content_type, "Stream-Next-Offset": format_offset(r.next)}
    if r.closed:
        h["Stream-Closed"] = "true"
    if r.code == 201:
        h["Location"] = str(request.url.with_query(None))
        return web.Response(status=201, headers=h)
    if r.code == 409:
        return _error(409, "the stream exists with another configuration", h)
    return web.Response(status=200, headers=h)


async def _post(
    request: web.Request, durable: Durable, ref: store.StreamRef, grant: Grant
) -> web.Response:
    w = _write_headers(request, "post")
    body = await durable.body(request)
    if not body and not w.close:
        raise BadRequest("an empty body appends nothing (Stream-Closed: true closes)")
    if body and not w.media_type:
        raise BadRequest("Content-Type is required with a body")
    json_mode = w.media_type == "application/json"
    msgs = await durable.parser.messages(body, json_mode, allow_empty_array=False)
    w = store.Write(**{**w.__dict__, "has_body": bool(body)})
    streams = durable.ready()[0].streams
    r = await quota.write(durable.quota, streams, ref, w, msgs, grant)
    h = {"Stream-Next-Offset": format_offset(r.next)}
    if r.closed:
        h["Stream-Closed"] = "true"
    if r.code == 200 and not body:  # close-only with producer headers: nothing appended
        r = store.WriteResult(204, r.next, r.closed, r.a, r.b)
    if r.code in (200, 204):
        if (w.producer is not None and r.a + r.b > 0) or (w.producer and r.code == 200):
            h["Producer-Epoch"], h["Producer-Seq"] = str(r.a), str(r.b)
        elif w.producer is not None:
            h["Producer-Epoch"], h["Producer-Seq"] = str(w.producer[1]), str(w.producer[2])
        return web.Response(status=r.code, headers=h)
    if r.code == 404:
        return _error(404, "no such stream")
    if r.code == 410:
        return _error(410, "the stream is deleted (its forks still hold its data)")
    if r.code == 403:
        h["Producer-Epoch"] = str(r.a)
        return _error(403, "stale producer epoch (fenced)", h)
    if r.code == 400:
        return _error(400, "a new producer epoch starts at Producer-Seq 0", h)
    if r.closed:
        return _error(409, "the stream is closed", h)
    if w.producer is not None and r.b > 0:
        h["Producer-Expected-Seq"], h["Producer-Received-Seq"] = str(r.a), str(r.b)
        return _error(409, f"producer sequence gap: expected {r.a}, received {r.b}", h)
    return _error(409, "content type mismatch or Stream-Seq regression", h)


async def _session(request: web.Request, durable: Durable) -> web.StreamResponse:
    if request.method != "GET":
        return _error(405, "a session's stream is read with GET", {"Allow": "GET"})
    try:
        sid = parse_session(request.match_info["sid"])
    except InvalidSessionId as exc:
        raise BadRequest(str(exc)) from None
    grant = durable.gate.check(request, sid, "watch", durable.server.address(request))
    broker, waker = durable.ready()
    source = SessionSource(broker, sid)
    if request.query.get("live") is None:
        with durable.gate.live(grant):  # a catch-up read counts, but watches nothing
            return await reads.get(request, source, waker, durable.options(False, grant.address))
    # a live read watches the session: counted as a viewer like an SSE or WebSocket
    # screen, so a turn read only here is not stopped for nobody watching
    with durable.gate.live(grant):
        async with viewing(durable.hub(), sid):
            return await reads.get(request, source, waker, durable.options(False, grant.address))


def handlers(durable: Durable) -> dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]:
    """The handlers of the table's ``durable.*`` routes (relay/service/routes.py: every
    method of a stream on one resource, so that no method meets aiohttp's 405 of another)."""

    async def durable_stream(request: web.Request) -> web.StreamResponse:
        return await _guarded(request, durable, request.match_info["path"])

    async def durable_session(request: web.Request) -> web.StreamResponse:
        return await _guarded(request, durable, None)

    return {"durable.stream": durable_stream, "durable.session": durable_session}
