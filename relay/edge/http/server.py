"""The edge server: SSE and WebSocket streams of a session's frames, health, metrics.

HTTP contract (docs/openapi.yaml; close codes and error bodies in docs/PROTOCOL.md):

- ``GET /v1/sessions/{sid}/events`` (SSE), ``GET /v1/sessions/{sid}/ws`` (WebSocket),
  ``GET /v1/sessions/{sid}/ui-stream`` (the AI SDK's UI message stream):
  :mod:`relay.edge.http.handlers`, one connection object each (:mod:`relay.edge.conn`).
- Token: ``Authorization: Bearer <t>`` or ``?token=<t>`` (see :mod:`relay.protocol.auth`).
- ``GET /healthz`` (200 while the process lives), ``GET /readyz`` (503 with ``status``
  and ``reasons`` while starting, draining, without Redis, or while a critical
  background loop keeps failing), ``GET /metrics``, ``GET /openapi.json``.

Refusals before a stream starts are JSON ``{"error": code, "reason": sentence}`` with
400 / 401 / 403 / 410 / 429 / 503 (:class:`relay.protocol.codes.Refusal`). Frames reach a
socket through its connection (:class:`relay.edge.conn.base.Conn`): written straight from
the hub's reader while the transport has room, queued (bounded, conflating) while it
pushes back and drained by the connection's own task; the hub never waits on a socket,
and a socket that does not drain within ``write_timeout_s`` is closed as a slow
consumer. Heartbeats and WebSocket pings come from one timer for all connections
(:mod:`relay.edge.conn.beats`). The stream handlers answer a :class:`Reject` themselves
(``server.refuse``): the app has no middleware, so a new handler that refuses must too.

Background work (the heartbeat timer, the loop-lag sampler, the first connection to
Redis, and the hub's subscriber, presence and reaper loops) runs on one
:class:`relay.service.supervise.Supervisor` per server, whose metrics go to the relay's
registry and whose readiness reasons ``/readyz`` reports.

Redis unreachable at start: by default the server keeps trying to connect in the
background (``/healthz`` 200, ``/readyz`` 503 ``redis_unreachable``, streams refused
with 503 ``unavailable``); with ``fail_fast`` the start-up fails instead (the command
prints one line and exits 1).

Order of use: ``app = make_app(config)`` (creates the RedisCluster client, its broker and
the hub on startup, closes them on cleanup; pass ``hub=`` to use one you own), run it;
on SIGTERM ``await app[SERVER].drain()`` then clean up (see :mod:`relay.edge.cli`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from typing import Any, Final
from urllib.parse import parse_qsl

import orjson
from aiohttp import web
from multidict import istr

from relay.broker.base import MessageHandler
from relay.broker.errors import RelayError, SessionDeleted, WatchClosed
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.connect import mask_url, startup_error
from relay.edge.config import RelayConfig
from relay.edge.conn import beats
from relay.edge.conn.base import Conn, transports
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.edge.http.limits import Access, StreamGuard, token_key
from relay.edge.metrics import OutMeter, RelayMetrics
from relay.protocol.auth import AuthError
from relay.protocol.codes import CloseCode, Readiness, Refusal
from relay.protocol.frame import now_ms
from relay.protocol.keys import InvalidSessionId, parse_session
from relay.service import cors, settings
from relay.service.clientaddr import BadForwardedFor, client_address, parse_networks
from relay.service.errors import RETRY_AFTER, Reject, admin_refused
from relay.service.supervise import QUICK_BACKOFF, Supervisor
from relay.service.tokens import challenge, request_claims

__all__ = ["EdgeServer", "deleted", "query_value"]

log = logging.getLogger(__name__)


_X_RELAY_ID: Final = istr("X-Relay-Id")
_CONNECT_LOG_EVERY: Final = 20  # while Redis stays unreachable at start: one line per N tries

WATCH_TIMEOUT_S: Final = 10.0  # subscribe + replay; past it the client gets 503 unavailable
SHUTDOWN_REASON: Final = "the relay is restarting; reconnect"


class EdgeServer:
    """State of one edge server app: config, hub, metrics, open streams, drain flag.

    The stream handlers (:mod:`relay.edge.http.handlers`) use it to admit a connection
    (:meth:`admit`) and the connection calls :meth:`end_stream` when it is over
    (:class:`relay.edge.conn.base.ConnHost`)."""

    def __init__(self, config: RelayConfig, hub: Hub | None = None) -> None:
        self.config = config
        self.metrics = RelayMetrics(config.relay_id)
        self.supervisor = Supervisor(self.metrics.registry, backoff=QUICK_BACKOFF)
        m = self.metrics
        # one bound method per transport, shared by its sockets (not one per socket); every
        # transport imported has its series from the start (a new one needs no line here)
        self._senders: dict[str, Callable[[list[Delivery], int], None]] = {
            t: OutMeter(m, t).sent for t in transports()
        }
        self._publish_to_edge = m.publish_to_edge.labels()
        self.hub: Hub | None = hub
        self.broker: RedisBroker | None = None  # the broker this server made (its client)
        self.broker_tap: MessageHandler | None = None  # the Durable Streams live reads'
        self._owns_hub = hub is None
        self.started = hub is not None
        self.draining = False
        self.streams: set[Conn] = set()
        self._closing: set[asyncio.Future[None]] = set()  # abandoned watches being closed
        self.admitted = 0  # streams past admission (includes those still opening)
        self.keys = config.keyset()  # None: auth off
        self.admin_key = settings.check_admin_key(config.admin_key)  # None: local reads only
        self.trusted = parse_networks(config.trusted_proxies)
        self.guard = StreamGuard(config.max_streams_per_token, config.max_streams_per_address)
        self.preflight = cors.preflight(config.cors_origin)  # a stream's OPTIONS
        if hub is not None:
            self._bind(hub)

    # -- lifecycle -----------------------------------------------------------------------

    async def startup(self, app: web.Application) -> None:
        if self.hub is None:
            if self.config.fail_fast:
                await self._connect()  # a failure fails the start-up: one line, exit 1
            else:
                try:
                    await self._connect()  # ready as soon as the app runs, when Redis is up
                except Exception as exc:  # whatever it is, Redis is not usable yet
                    log.warning("%s; trying again in the background", self._cannot(exc))
                    self.supervisor.set_condition(Readiness.REDIS_UNREACHABLE, True)
                    self.supervisor.spawn("redis_connect", self._connect_until_up())
        # neither loop is critical: a dead heartbeat timer lets proxies cut idle streams
        # (clients resume), a dead lag sampler loses a metric; both are bugs, logged
        self.supervisor.forever("sse_heartbeats", self._heartbeats, critical=False)
        self.supervisor.forever("loop_lag", self._loop_lag, critical=False)
        self.started = True

    async def _connect(self) -> None:
        """Connect to Redis and start the hub on this server's supervisor."""
        cfg = self.config
        broker = await RedisBroker.connect(
            cfg.redis_url, cfg.relay_id, tls=cfg.redis_tls, maxlen=cfg.backlog_maxlen,
            ttl_s=cfg.session_ttl_s, max_bytes=cfg.backlog_max_bytes,
        )  # fmt: skip
        try:
            hub = Hub(
                broker,
                queue_frames=cfg.queue_frames,
                hard_limit_frames=cfg.hard_limit_frames,
                max_pending_bytes=cfg.max_pending_bytes,
                replay_budget_bytes=cfg.replay_budget_bytes,
                unsubscribe_delay_s=cfg.unsubscribe_delay_s,
                screens_interval_s=cfg.presence_interval_s,
                reap_after_s=cfg.reap_after_s,
                reap_interval_s=min(cfg.reap_after_s, 1.0),  # 0 disables the reaper
                supervisor=self.supervisor,
            )
            hub.tap = self.broker_tap
            await hub.start()
        except BaseException:
            await broker.aclose()
            raise
        self.broker, self.hub = broker, hub
        self._bind(hub)

    async def _connect_until_up(self) -> None:
        """Try the first connection until it succeeds (the supervisor's backoff between
        tries), with ``redis_unreachable`` raised meanwhile."""
        tries = 1  # the first one failed in startup()
        while True:
            await asyncio.sleep(self.supervisor.backoff.delay(tries))
            try:
                await self._connect()
            except Exception as exc:  # whatever it is, Redis is not usable yet: try again
                tries += 1
                if tries % _CONNECT_LOG_EVERY == 0:
                    log.warning("%s (%d tries)", self._cannot(exc), tries)
                continue
            self.supervisor.set_condition(Readiness.REDIS_UNREACHABLE, False)
            log.info("connected to Redis at %s", mask_url(self.config.redis_url))
            return

    def _cannot(self, exc: BaseException) -> str:
        """One line: the Redis URL (password masked) and the cause."""
        return startup_error(self.config.redis_url, exc)

    def _bind(self, hub: Hub) -> None:
        self.metrics.bind_hub(hub.stats)
        hub.live_observers.append(self._on_live)

    async def on_shutdown(self, app: web.Application) -> None:
        await self.drain()

    async def cleanup(self, app: web.Application) -> None:
        self.started = False
        await self.supervisor.stop()  # before the hub closes: its loops run on it too
        self.metrics.bind_hub(None)
        if self.hub is not None and self._on_live in self.hub.live_observers:
            self.hub.live_observers.remove(self._on_live)
        if self._owns_hub:
            if self.hub is not None:
                await self.hub.close()
            if self.broker is not None:
                await self.broker.aclose()

    async def drain(self, deadline_s: float | None = None) -> None:
        """readyz -> 503, refuse new streams, tell every client to reconnect (SSE: retry
        hint + close comment; WS: close 1012), wait up to the deadline, then cancel."""
        deadline = self.config.drain_deadline_s if deadline_s is None else deadline_s
        self.draining = True
        self.metrics.draining.set(1)
        for c in list(self.streams):
            c.kick(CloseCode.RELAY_SHUTDOWN, SHUTDOWN_REASON)
        done = {c.ended() for c in self.streams}
        if done:
            _, pending = await asyncio.wait(done, timeout=deadline)
            for f in pending:
                f.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    def not_ready(self) -> list[str]:
        """The supervisors' reasons not to take traffic (this server's, and the hub's
        own when the hub was passed in)."""
        reasons = self.supervisor.not_ready()
        if self.hub is not None and self.hub.supervisor is not self.supervisor:
            reasons += self.hub.supervisor.not_ready()
        return reasons

    # -- admission ---------------------------------------------------------------------

    def session(self, request: web.Request) -> str:
        try:
            return parse_session(request.match_info["sid"])
        except InvalidSessionId as exc:
            raise Reject(400, Refusal.INVALID_SESSION, str(exc)) from None

    def address(self, request: web.Request) -> str:
        """The client's address (through trusted proxies); Reject 400 for a bad header."""
        try:
            return client_address(
                request.remote,
                request.headers.get("X-Forwarded-For"),
                self.trusted,
                ipv6_prefix=self.config.ipv6_prefix,
            )
        except BadForwardedFor as exc:
            raise Reject(400, Refusal.INVALID_FORWARDED_FOR, str(exc)) from None

    def authorize(self, request: web.Request, sid: str) -> Access:
        """The verified token (limits and expiry are applied to it in :meth:`admit`)."""
        address = self.address(request)
        if self.keys is None:
            return Access(None, 0, address)
        try:
            claims = request_claims(self.keys, request, sid,
                                    max_lifetime_s=self.config.session_ttl_s)  # fmt: skip
        except AuthError as exc:
            self.metrics.auth_failures.labels(exc.error).inc()
            raise Reject(exc.status, exc.error, exc.reason, challenge(exc)) from None
        return Access(claims, token_key(claims), address)

    def check_capacity(self) -> Hub:
        """The hub, or :class:`Reject` 503 unless a stream may open now."""
        if self.draining or not self.started:
            raise Reject(
                503, Refusal.DRAINING, "the relay is restarting; connect again", RETRY_AFTER
            )
        if self.hub is None:
            raise Reject(
                503, Refusal.UNAVAILABLE, "the relay is not connected to Redis yet", RETRY_AFTER
            )
        if self.admitted >= self.config.max_connections:
            raise Reject(503, Refusal.OVERLOADED, "too many streams on this relay", RETRY_AFTER)
        return self.hub

    def conn_options(self, transport: str) -> dict[str, Any]:
        """What every connection of ``transport`` is built with (host, meter, timeout)."""
        sent = self._senders.get(transport)
        if sent is None:  # a connection class imported after this server was made
            sent = self._senders[transport] = OutMeter(self.metrics, transport).sent
        return {
            "host": self,
            "sent": sent,
            "write_timeout_s": self.config.write_timeout_s,
        }

    async def admit(self, conn: Conn, access: Access) -> None:
        """Count ``conn`` in the limits and open its watch on the hub (subscribe, replay);
        :class:`Reject` 429 / 503 when it may not, 410 when the session was deleted
        (the hub's first read of it found its tombstone). Once admitted, the connection ends in
        :meth:`end_stream` (it calls it when it is over)."""
        hub = self.check_capacity()
        self.guard.admit(conn, access)  # 429 past the per-token / per-address limits
        self.admitted += 1
        # The watch opens in a task of its own: a client that hangs up (its handler is
        # cancelled) or a timeout must not cancel redis-py mid-command, which breaks the
        # pooled connection for other requests. An abandoned watch is closed once open.
        # (a task of the supervisor: a failure is logged there, with its details)
        opening = self.supervisor.spawn(f"open:{conn.sid}", _open(hub, conn))
        try:
            opened = await asyncio.wait_for(asyncio.shield(opening), WATCH_TIMEOUT_S)
        except WatchClosed as exc:
            self._not_admitted(conn)
            raise Reject(503, Refusal.DRAINING, exc.reason, RETRY_AFTER) from None
        except (RelayError, TimeoutError) as exc:
            self._not_admitted(conn)
            if not opening.done():
                opening.add_done_callback(functools.partial(self._close_abandoned, conn))
                log.warning("watch of %s: no answer in %.0f s", conn.sid, WATCH_TIMEOUT_S)
            raise Reject(503, Refusal.UNAVAILABLE, "cannot watch the session", RETRY_AFTER) from exc
        except BaseException:
            self._not_admitted(conn)
            opening.add_done_callback(functools.partial(self._close_abandoned, conn))
            raise
        if not opened:
            self._not_admitted(conn)
            raise deleted()
        self.streams.add(conn)
        self.guard.bind(conn)  # ends the stream (token_expired) when the token expires
        m = self.metrics
        t = conn.transport_kind
        m.accepted.labels(t).inc()
        m.connections.labels(t).inc()
        m.watches.inc()
        if conn.offset is not None:
            m.resumes.labels(t).inc()
        if self.draining:  # drain began while the watch was opening
            conn.kick(CloseCode.RELAY_SHUTDOWN, SHUTDOWN_REASON)

    def _not_admitted(self, conn: Conn) -> None:
        self.admitted -= 1
        self.guard.release(conn)

    def _close_abandoned(self, conn: Conn, opening: asyncio.Future[bool]) -> None:
        """A watch whose client left (or timed out) while it opened: close it once open."""
        if opening.cancelled() or opening.exception() is not None:
            return
        conn.shut("the client left before its watch opened", CloseCode.CLIENT_GONE)

    def end_stream(self, conn: Conn, code: CloseCode) -> None:
        """An admitted connection is over (``code``: why): counted, limits released."""
        if conn not in self.streams:
            return
        self.streams.discard(conn)
        self.admitted -= 1
        self.guard.release(conn)
        conn.shut("watch closed", CloseCode.CLOSED)
        m = self.metrics
        t = conn.transport_kind
        m.connections.labels(t).dec()
        m.watches.dec()
        m.closes.labels(t, code).inc()
        if code is CloseCode.SLOW_CONSUMER:
            m.slow_disconnects.labels(t).inc()

    # -- writing -------------------------------------------------------------------------

    def _on_live(self, ds: list[Delivery]) -> None:
        """The live frames of one read from Redis (once per frame, however many sockets
        watch): producer ``ts`` to now crosses processes, so wall clock."""
        h, now = self._publish_to_edge, now_ms()
        counts, bounds = h.counts, h.bounds
        for d in ds:
            if d.ts > 0:
                seconds = max(now - d.ts, 0) / 1000.0
                counts[bisect_left(bounds, seconds)] += 1
                h.total += seconds

    def refuse(self, reject: Reject) -> web.Response:
        self.metrics.rejected.labels(reject.error).inc()
        return reject.response()

    def hello(self, conn: Conn) -> bytes:
        """First message of every stream: which relay, resuming after which offset."""
        return orjson.dumps({"type": "hello", "relay": self.config.relay_id, "from": conn.offset})

    async def guarded(self, conn: Conn, write: Awaitable[Any]) -> None:
        """One write through aiohttp (before the socket is the connection's); if it does
        not finish in ``write_timeout_s`` the connection is cut. A timer, not
        ``asyncio.timeout``: a cancellation racing a completed write would leak into the
        task's next await (Python 3.11)."""
        handle = asyncio.get_running_loop().call_later(self.config.write_timeout_s, conn.cut)
        try:
            await write
        finally:
            handle.cancel()

    # -- background loops ----------------------------------------------------------------

    async def _loop_lag(self) -> None:
        """Every 10 ms, how late the timer fired: a sample of the loop's longest turns."""
        loop = asyncio.get_running_loop()
        observe = self.metrics.loop_lag.labels().observe
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.01)
            observe(max(loop.time() - t0 - 0.01, 0.0))

    async def _heartbeats(self) -> None:
        """Heartbeats and WebSocket pings: one timer for every connection."""
        await beats.run(self.streams, self.config.heartbeat_s)

    # -- handlers ------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive", "relay": self.config.relay_id})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 ``{"status": "ready", "reasons": []}``, or 503 with ``status`` (the first
        of draining, starting, redis_unreachable, not_ready), every reason and a sentence."""
        relay = self.config.relay_id

        def not_ready(status: Readiness, reasons: list[str], reason: str) -> web.Response:
            body = {"status": status, "relay": relay, "reasons": reasons, "reason": reason}
            return web.json_response(body, status=503)

        if self.draining:
            return not_ready(Readiness.DRAINING, [Readiness.DRAINING], "the relay drains")
        if not self.started:
            return not_ready(Readiness.STARTING, [Readiness.STARTING], "the relay is starting")
        reasons = self.not_ready()
        if self.hub is not None and Readiness.REDIS_UNREACHABLE not in reasons:
            try:
                await asyncio.wait_for(self.hub.broker.ping(), 1.0)  # cancels only the ping
            except Exception as exc:  # any failure means "not ready"; details only in the log
                log.warning("readyz: redis ping failed: %r", exc)
                reasons.insert(0, Readiness.REDIS_UNREACHABLE)
        if Readiness.REDIS_UNREACHABLE in reasons:
            said = "redis did not answer a ping" if self.hub is not None else (
                "the relay has not reached Redis yet")  # fmt: skip
            return not_ready(Readiness.REDIS_UNREACHABLE, reasons, said)
        if reasons:
            return not_ready(Readiness.NOT_READY, reasons, "background work keeps failing")
        return web.json_response({"status": Readiness.READY, "relay": relay, "reasons": []})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        refused = admin_refused(request, self.admin_key)
        if refused is not None:
            return self.refuse(refused)
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        headers = response.headers  # istr names: see relay.edge.http.handlers.SSE_HEADERS
        headers[_X_RELAY_ID] = self.config.relay_id
        cors.allow(headers, self.config.cors_origin)  # every answer: the streams' rule


async def _open(hub: Hub, conn: Conn) -> bool:
    """``hub.open(conn)``; False when the session was deleted: a refusal of the client's
    request, not a failure of the relay's to log."""
    try:
        await hub.open(conn)
    except SessionDeleted:
        return False
    return True


def deleted() -> Reject:
    """410 ``session_deleted``: the session's tombstone exists (it was deleted; its
    tokens, minted before, are refused until the longest token lifetime has passed)."""
    return Reject(
        410, Refusal.SESSION_DELETED, "the session was deleted; nothing of it can be watched"
    )


def query_value(request: web.Request, name: str) -> str | None:
    """The first ``name`` parameter of the request's query string (decoded, ``+`` as a
    space), or None. Parsed here and dropped: ``request.query`` would keep a parsed
    copy of the query with the request for as long as the stream lasts."""
    raw = request.rel_url.raw_query_string
    if not raw:
        return None
    for key, value in parse_qsl(raw, keep_blank_values=True):
        if key == name:
            return value
    return None
