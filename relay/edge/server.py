"""The edge server: SSE and WebSocket streams of a session's frames, health, metrics.

HTTP contract (docs/openapi.yaml; close codes and error bodies in docs/PROTOCOL.md):

- ``GET /v1/sessions/{sid}/events``: SSE. ``retry:`` and an ``event: hello`` first,
  then per frame ``id: <offset>`` / ``event: <kind>`` / ``data: <frame JSON>``, a
  heartbeat comment after ``heartbeat_s`` of silence, a ``: close <code> <reason>``
  comment last. Resume: ``Last-Event-ID`` header or ``last_event_id`` query.
- ``GET /v1/sessions/{sid}/ws``: WebSocket. ``{"type":"hello",...}`` first, then one
  text message per frame (the frame JSON as published). Resume: ``?from=<offset>``.
- Token: ``Authorization: Bearer <t>`` or ``?token=<t>`` (see :mod:`relay.protocol.auth`).
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /openapi.json``
  (docs/openapi.yaml, the relay's part).

Refusals before a stream starts are JSON ``{"error": code, "reason": sentence}`` with
400 / 401 / 403 / 503. Frames reach a socket through its hub :class:`~relay.edge.tap.Tap`:
written straight from the hub's reader while the transport has room, queued (bounded,
conflating) while it pushes back and drained by the stream's own task (the SSE handler
task; the WebSocket writer task, while the handler task reads); the hub never waits on
a socket, and a socket that does not drain within ``write_timeout_s`` is closed as a
slow consumer. SSE heartbeats come from one timer for all streams.

Order of use: ``app = make_app(config)`` (creates the RedisCluster client and the hub
on startup, closes them on cleanup; pass ``hub=`` to use one you own), run it;
on SIGTERM ``await app[SERVER].drain()`` then clean up (see :mod:`relay.edge.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson
from aiohttp import WSMsgType, web
from aiohttp.abc import AbstractStreamWriter
from redis.asyncio.cluster import RedisCluster

from relay.edge import openapi, uistream
from relay.edge.config import RelayConfig
from relay.edge.hub import Delivery, Hub, Tap
from relay.edge.metrics import RelayMetrics
from relay.edge.streamguard import Access, StreamGuard, Ticket
from relay.edge.streams import (
    CORS_HEADERS,
    GOODBYE_S,
    RETRY_AFTER,
    SSE_FRAMES,
    WS_CLOSE,
    WS_FRAMES,
    Reject,
    SocketOut,
    Stream,
    client_reason,
    discard,
    is_ping,
    jitter,
)
from relay.protocol import sse
from relay.protocol.auth import AuthError, extract_token, verify_token
from relay.protocol.frame import now_ms
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.redisio.connect import connect
from relay.redisio.errors import RelayError, WatchClosed
from relay.service import runtime
from relay.service.clientaddr import client_address, parse_networks

__all__ = ["SERVER", "EdgeServer", "make_app", "make_runner"]

log = logging.getLogger(__name__)


_HEARTBEAT: Final = sse.comment("heartbeat")
_BEAT_SLICE: Final = 500  # streams looked at per event-loop turn by the heartbeat timer


WATCH_TIMEOUT_S: Final = 10.0  # subscribe + replay; past it the client gets 503 unavailable


class EdgeServer:
    """State of one edge server app: config, hub, metrics, open streams, drain flag."""

    def __init__(self, config: RelayConfig, hub: Hub | None = None) -> None:
        self.config = config
        self.metrics = RelayMetrics(config.relay_id)
        m = self.metrics
        self._out_metrics = {  # label children bound once: _sent runs per socket write
            t: (m.frames_out.labels(t), m.bytes_out.labels(t), m.hop_latency.labels(t),
                m.edge_to_socket.labels(t))
            for t in ("sse", "ws")
        }  # fmt: skip
        self.hub: Hub | None = hub
        self.redis: RedisCluster | None = hub.redis if hub is not None else None
        self._owns_hub = hub is None
        self.started = hub is not None
        self.draining = False
        self.streams: set[Stream] = set()
        self._closing: set[asyncio.Future[None]] = set()  # abandoned watches being closed
        self.admitted = 0  # streams past admission (includes those still opening)
        self._beat_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.keys = config.keyset()  # None: auth off
        self.trusted = parse_networks(config.trusted_proxies)
        self.guard = StreamGuard(config.max_streams_per_token, config.max_streams_per_address)
        self._tickets: dict[Stream, Ticket] = {}
        if hub is not None:
            self.metrics.bind_hub(hub.stats)
            hub.live_observers.append(self._on_live)

    # -- lifecycle -----------------------------------------------------------------------

    async def startup(self, app: web.Application) -> None:
        if self.hub is None:
            cfg = self.config
            self.redis = connect(cfg.redis_url, tls=cfg.redis_tls)  # a burst waits
            await self.redis.initialize()
            self.hub = Hub(
                self.redis,
                queue_frames=cfg.queue_frames,
                hard_limit_frames=cfg.hard_limit_frames,
                max_pending_bytes=cfg.max_pending_bytes,
                replay_budget_bytes=cfg.replay_budget_bytes,
                unsubscribe_delay_s=cfg.unsubscribe_delay_s,
                reap_after_s=cfg.reap_after_s,
                reap_interval_s=min(cfg.reap_after_s, 1.0),  # 0 disables the reaper
                relay_id=cfg.relay_id,
            )
            await self.hub.start()
            self.metrics.bind_hub(self.hub.stats)
            self.hub.live_observers.append(self._on_live)
        self._beat_task = asyncio.create_task(self._heartbeats(), name="sse-heartbeats")
        self._lag_task = asyncio.create_task(self._loop_lag(), name="loop-lag")
        self.started = True

    async def on_shutdown(self, app: web.Application) -> None:
        await self.drain()

    async def cleanup(self, app: web.Application) -> None:
        self.started = False
        discard(self._beat_task)
        discard(self._lag_task)
        self.metrics.bind_hub(None)
        if self.hub is not None and self._on_live in self.hub.live_observers:
            self.hub.live_observers.remove(self._on_live)
        if self._owns_hub:
            if self.hub is not None:
                await self.hub.close()
            if self.redis is not None:
                await self.redis.aclose()

    async def drain(self, deadline_s: float | None = None) -> None:
        """readyz -> 503, refuse new streams, tell every client to reconnect (SSE: retry
        hint + close comment; WS: close 1012), wait up to the deadline, then cancel."""
        deadline = self.config.drain_deadline_s if deadline_s is None else deadline_s
        self.draining = True
        self.metrics.draining.set(1)
        for s in list(self.streams):
            await s.kick("relay_shutdown", "the relay is restarting; reconnect")
        tasks = {s.task for s in self.streams if s.task is not None}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    # -- admission -----------------------------------------------------------------------

    def _session(self, request: web.Request) -> str:
        try:
            return parse_session(request.match_info["sid"])
        except InvalidSessionId as exc:
            raise Reject(400, "bad_session", str(exc)) from None

    def _authorize(self, request: web.Request, sid: str) -> Access:
        """The verified token (limits and expiry are applied to it in :meth:`_open`)."""
        address = client_address(
            request.remote, request.headers.get("X-Forwarded-For"), self.trusted
        )
        if self.keys is None:
            return Access(None, "", address)
        try:
            token = extract_token(request.headers.get("Authorization"), request.query.get("token"))
            claims = verify_token(self.keys, token, sid, time.time())
        except AuthError as exc:
            self.metrics.auth_failures.labels(exc.error).inc()
            headers = {"WWW-Authenticate": 'Bearer realm="tokenrelay"'} if exc.status == 401 else {}
            raise Reject(exc.status, exc.error, exc.reason, headers) from None
        return Access(claims, token, address)

    def _offset(self, parse: Callable[[], int | None]) -> int | None:
        try:
            return parse()
        except sse.OffsetError as exc:
            raise Reject(400, "bad_offset", str(exc)) from None

    def _check_capacity(self) -> None:
        if self.draining or not self.started or self.hub is None:
            raise Reject(503, "draining", "the relay is restarting; connect again", RETRY_AFTER)
        if self.admitted >= self.config.max_connections:
            raise Reject(503, "overloaded", "too many streams on this relay", RETRY_AFTER)

    async def _open(self, transport: str, sid: str, offset: int | None, access: Access) -> Stream:
        """Admit and watch; the caller must call :meth:`_close` once done."""
        self._check_capacity()
        assert self.hub is not None
        ticket = self.guard.admit(access)  # 429 past the per-token / per-address limits
        self.admitted += 1
        # The watch opens in a task of its own: a client that hangs up (its handler is
        # cancelled) or a timeout must not cancel redis-py mid-command, which breaks the
        # pooled connection for other requests. An abandoned watch is closed once open.
        opening = asyncio.ensure_future(self.hub.watch(sid, offset))
        try:
            watch = await asyncio.wait_for(asyncio.shield(opening), WATCH_TIMEOUT_S)
        except WatchClosed as exc:
            self.admitted -= 1
            ticket.release()
            raise Reject(503, "draining", exc.reason, RETRY_AFTER) from None
        except (RelayError, TimeoutError) as exc:
            self.admitted -= 1
            ticket.release()
            if not opening.done():
                opening.add_done_callback(self._close_abandoned)
            log.warning("watch of %s failed: %r", sid, exc)  # details here, not to clients
            raise Reject(503, "unavailable", "cannot watch the session", RETRY_AFTER) from None
        except BaseException:
            self.admitted -= 1
            ticket.release()
            opening.add_done_callback(self._close_abandoned)
            raise
        stream = Stream(transport, sid, offset, watch)
        self.streams.add(stream)
        self._tickets[stream] = ticket
        ticket.bind(stream)  # ends the stream (token_expired) when the token expires
        m = self.metrics
        m.accepted.labels(transport).inc()
        m.connections.labels(transport).inc()
        m.watches.inc()
        if offset is not None:
            m.resumes.labels(transport).inc()
        if self.draining:  # drain began while the watch was opening
            await stream.kick("relay_shutdown", "the relay is restarting; reconnect")
        return stream

    def _close_abandoned(self, opening: asyncio.Future[Tap]) -> None:
        """A watch whose client left (or timed out) while it opened: close it once open."""
        if opening.cancelled() or opening.exception() is not None:
            return
        task = asyncio.ensure_future(opening.result().close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, stream: Stream, code: str) -> None:
        self.streams.discard(stream)
        self.admitted -= 1
        ticket = self._tickets.pop(stream, None)
        if ticket is not None:
            ticket.release()
        await stream.watch.close()
        m = self.metrics
        m.connections.labels(stream.transport).dec()
        m.watches.dec()
        m.closes.labels(stream.transport, code).inc()
        if code == "slow_consumer":
            m.slow_disconnects.labels(stream.transport).inc()

    def _on_live(self, d: Delivery) -> None:
        """A live frame read from Redis (once per frame, however many sockets watch)."""
        if d.ts > 0:
            self.metrics.publish_to_edge.observe(max(d.received_ms - d.ts, 0) / 1000.0)

    def _sent(self, transport: str, batch: list[Delivery], nbytes: int) -> None:
        m = self.metrics
        frames, sent_bytes, total, queued = self._out_metrics[transport]
        frames.inc(len(batch))
        sent_bytes.inc(nbytes)
        now = now_ms()
        for d in batch:
            if d.kind == "gap":
                m.gaps.inc()
            if d.received_ms <= 0:
                continue  # replayed from the backlog: not a hop of the live path
            queued.observe(max(now - d.received_ms, 0) / 1000.0)
            if d.ts > 0:
                total.observe(max(now - d.ts, 0) / 1000.0)

    def _hello(self, stream: Stream) -> bytes:
        """First message of every stream: which relay, resuming after which offset."""
        return orjson.dumps({"type": "hello", "relay": self.config.relay_id, "from": stream.offset})

    async def _guarded(self, stream: Stream, write: Awaitable[Any], timeout_s: float) -> None:
        """One socket write; if it does not finish in ``timeout_s`` the connection is cut
        (:meth:`Stream.cut`). A timer, not ``asyncio.timeout``: a cancellation racing a
        completed write would leak into the task's next await (Python 3.11)."""
        handle = asyncio.get_running_loop().call_later(timeout_s, stream.cut)
        try:
            await write
        finally:
            handle.cancel()

    # -- SSE -----------------------------------------------------------------------------

    async def sse_handler(self, request: web.Request) -> web.StreamResponse:
        sid = self._session(request)
        access = self._authorize(request, sid)
        offset = self._offset(
            lambda: sse.resume_offset(
                request.headers.get("Last-Event-ID"), request.query.get("last_event_id")
            )
        )
        stream = await self._open("sse", sid, offset, access)
        code = "closed"
        try:
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            writer = await resp.prepare(request)
            stream.sock = request.transport
            assert writer is not None
            code = await self._sse_loop(resp, writer, stream)
            return resp
        except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
            code = lost_code(stream, code)
            raise
        except Exception:
            code = "internal"
            raise
        finally:
            await self._close(stream, code)

    async def _sse_loop(
        self, resp: web.StreamResponse, writer: AbstractStreamWriter, stream: Stream
    ) -> str:
        cfg = self.config

        async def put(data: bytes, timeout_s: float = cfg.write_timeout_s) -> None:
            await self._guarded(stream, resp.write(data), timeout_s)

        try:
            await put(sse.preamble(cfg.retry_ms, self._hello(stream)))  # sends the head too
            assert stream.sock is not None
            stream.out = SocketOut(
                stream,
                stream.sock,
                writer,
                SSE_FRAMES,
                functools.partial(self._sent, "sse"),
                cfg.write_timeout_s,
            )
            await stream.watch.run(stream.out)
        except WatchClosed as exc:
            code, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            return stream.stop[0] if stream.stop is not None else "client_gone"
        finally:
            stream.out = None
        retry = jitter(cfg.retry_ms) if code == "relay_shutdown" else cfg.retry_ms
        with contextlib.suppress(ConnectionError, RuntimeError):
            await put(sse.goodbye(code, reason, retry), GOODBYE_S)
            await self._guarded(stream, resp.write_eof(), GOODBYE_S)
        return code

    async def _loop_lag(self) -> None:
        """Every 10 ms, how late the timer fired: a sample of the loop's longest turns."""
        loop = asyncio.get_running_loop()
        observe = self.metrics.loop_lag.labels().observe
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.01)
            observe(max(loop.time() - t0 - 0.01, 0.0))

    async def _heartbeats(self) -> None:
        """One timer for every SSE stream: a comment on each stream silent for
        ``heartbeat_s`` (written only if nothing is queued and the socket has room)."""
        period = self.config.heartbeat_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period / 2)
            due = loop.time() - period
            for i, s in enumerate(list(self.streams)):
                out = s.out
                if out is not None and s.transport == "sse" and out.last_write <= due:
                    s.watch.try_write(lambda o=out: o.write(_HEARTBEAT))  # type: ignore[misc]
                if i % _BEAT_SLICE == _BEAT_SLICE - 1:
                    await asyncio.sleep(0)

    # -- WebSocket -----------------------------------------------------------------------

    async def ws_handler(self, request: web.Request) -> web.StreamResponse:
        sid = self._session(request)
        access = self._authorize(request, sid)
        offset = self._offset(lambda: sse.parse_offset(request.query.get("from"), name="from"))
        cfg = self.config
        ws = web.WebSocketResponse(
            heartbeat=cfg.heartbeat_s,
            max_msg_size=cfg.ws_max_message_bytes,
            compress=False,
            timeout=2.0,
        )
        if not ws.can_prepare(request).ok:
            raise Reject(400, "not_websocket", "this endpoint needs a WebSocket upgrade")
        stream = await self._open("ws", sid, offset, access)
        code = "closed"
        writer: asyncio.Task[str] | None = None
        try:
            pw = await ws.prepare(request)
            stream.sock = request.transport
            writer = asyncio.create_task(self._ws_writer(ws, pw, stream), name=f"ws-writer:{sid}")
            code = await self._ws_reader(ws, stream)
            if code != "writer_done":
                writer.cancel()
                if code != "client_gone":  # the client broke the protocol: we close
                    await self._ws_close(ws, stream, code, client_reason(code))
            await asyncio.wait([writer])
            if code == "writer_done":
                code = writer.result() if not writer.cancelled() else "closed"
            return ws
        except asyncio.CancelledError:  # the connection was lost (make_runner cancels)
            code = lost_code(stream, code)
            raise
        finally:
            if writer is not None and not writer.done():
                writer.cancel()
            await self._close(stream, code)

    async def _ws_reader(self, ws: web.WebSocketResponse, stream: Stream) -> str:
        """Read the client's messages in the handler task (aiohttp requires it)."""
        while True:
            msg = await ws.receive()
            if msg.type is WSMsgType.TEXT:
                if not is_ping(msg.data):
                    return "bad_message"
            elif msg.type is WSMsgType.BINARY:
                return "binary"
            elif msg.type is WSMsgType.ERROR:  # aiohttp already closed (1009 for too big)
                return "too_big" if ws.close_code == 1009 else "client_gone"
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return "writer_done" if stream.stop is not None else "client_gone"

    async def _ws_writer(
        self, ws: web.WebSocketResponse, writer: AbstractStreamWriter, stream: Stream
    ) -> str:
        cfg = self.config
        timeout_s = cfg.write_timeout_s
        try:
            await self._guarded(
                stream, ws.send_frame(self._hello(stream), WSMsgType.TEXT), timeout_s
            )
            assert stream.sock is not None
            stream.out = SocketOut(
                stream,
                stream.sock,
                writer,
                WS_FRAMES,
                functools.partial(self._sent, "ws"),
                timeout_s,
            )
            await stream.watch.run(stream.out)
        except WatchClosed as exc:
            code, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            return stream.stop[0] if stream.stop is not None else "client_gone"
        except Exception:  # never leave the reader waiting on a socket nobody closes
            log.exception("WebSocket writer of %s failed", stream.sid)
            code, reason = "internal", "internal error"
        finally:
            stream.out = None
        if stream.stop is None:
            stream.stop = (code, reason)
        await self._ws_close(ws, stream, code, reason)
        return code

    async def _ws_close(
        self, ws: web.WebSocketResponse, stream: Stream, code: str, reason: str
    ) -> None:
        num, default = WS_CLOSE.get(code, WS_CLOSE["internal"])
        message = (reason or default).encode()[:120]  # a close reason fits in 123 bytes
        with contextlib.suppress(ConnectionError, RuntimeError):
            # ws.close waits up to its own timeout (2 s) for the client's close frame
            await self._guarded(stream, ws.close(code=num, message=message), GOODBYE_S + 2.0)

    # -- health, metrics, CORS -----------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive", "relay": self.config.relay_id})

    async def readyz(self, request: web.Request) -> web.Response:
        relay = self.config.relay_id
        if self.draining:
            return web.json_response({"status": "draining", "relay": relay}, status=503)
        if not self.started or self.redis is None:
            return web.json_response({"status": "starting", "relay": relay}, status=503)
        try:
            await asyncio.wait_for(self.redis.ping(), 1.0)  # cancels only the ping
        except Exception as exc:  # any failure means "not ready"; details only in the log
            log.warning("readyz: redis ping failed: %r", exc)
            body = {"status": "redis_unreachable", "reason": "redis did not answer a ping"}
            return web.json_response({**body, "relay": relay}, status=503)
        return web.json_response({"status": "ready", "relay": relay})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def preflight(self, request: web.Request) -> web.Response:
        return web.Response(status=204, headers=CORS_HEADERS)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Relay-Id"] = self.config.relay_id
        response.headers["Access-Control-Allow-Origin"] = self.config.cors_origin
        response.headers.setdefault("Access-Control-Expose-Headers", "X-Relay-Id")


@web.middleware
async def _reject_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except Reject as r:
        server = request.app[SERVER]
        server.metrics.rejected.labels(r.error).inc()
        return r.response()


SERVER: Final = web.AppKey("tokenrelay_edge", EdgeServer)


def make_app(config: RelayConfig, hub: Hub | None = None) -> web.Application:
    """The aiohttp app of one edge server. ``hub``: use this started hub (the caller
    closes it); otherwise the app creates and closes a RedisCluster client and a hub."""
    config = config.validate()
    server = EdgeServer(config, hub)
    app = web.Application(middlewares=[_reject_middleware])
    app[SERVER] = server
    app.on_startup.append(server.startup)
    app.on_shutdown.append(server.on_shutdown)
    app.on_cleanup.append(server.cleanup)
    app.on_response_prepare.append(server.on_prepare)
    app.router.add_get("/v1/sessions/{sid:[^/]+}/events", server.sse_handler)
    app.router.add_get("/v1/sessions/{sid:[^/]+}/ws", server.ws_handler)
    app.router.add_route("OPTIONS", "/v1/sessions/{sid:[^/]+}/events", server.preflight)
    app.router.add_route("OPTIONS", "/v1/sessions/{sid:[^/]+}/ws", server.preflight)
    app.router.add_get("/healthz", server.healthz)
    app.router.add_get("/readyz", server.readyz)
    app.router.add_get("/metrics", server.metrics_handler)
    app.router.add_get("/openapi.json", openapi.handler("relay"))  # docs/openapi.yaml
    uistream.register(app, server)  # the AI SDK's UI message stream (relay/edge/uistream.py)
    return app


def lost_code(stream: Stream, code: str) -> str:
    """Why a stream whose handler was cancelled by a lost connection ended: the reason
    the server had already decided (slow consumer cut, protocol close) or client_gone."""
    if stream.stop is not None:
        return stream.stop[0]
    return "client_gone" if code == "closed" else code


def make_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The runner every relay uses. ``handler_cancellation``: a client that goes away
    cancels its stream handler at once, so an idle SSE stream does not hold its watch
    (and the shard subscription) until the next heartbeat write fails."""
    kwargs.setdefault("access_log", None)
    runtime.quiet_client_errors()
    return web.AppRunner(app, handler_cancellation=True, **kwargs)
