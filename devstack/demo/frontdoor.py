"""The demo's front door: one URL for the whole HTTP contract, no stickiness.

Every route of the route table (relay/service/routes.py) that a door proxies goes to the
service the table names: streams (``/v1/sessions/{sid}/events``, ``.../ws``, the AI
SDK's, a Responses stream ``GET /v1/responses/{id}?stream=true``) and Durable Streams to
a relay, session, turn and gateway paths to a worker; each request picks an upstream at
random (a client that reconnects lands anywhere, which is the point) and tries the next
one when an upstream refuses the connection. Streams pass through unbuffered, WebSocket
close codes pass through, but for the ones RFC 6455 forbids on the wire (1005, 1006,
1015: they only say that no close frame came): a relay that died (its socket dropped
without a close frame) is told to the client as 1012, "service restart", so that it
reconnects (:func:`sendable_close`). A WebSocket's subprotocols pass through too (a
browser sends its token as one: :mod:`relay.service.tokens`), and the one the relay
answers with is the door's answer.
Headers pass as through a reverse proxy: every end-to-end header (``Accept`` for the
closed loop, ``X-Session-Id`` for the gateway's session mode, ``Last-Event-ID``, ...) in
both directions, repeated ones repeated; hop-by-hop ones are dropped, and so is what a
client claims about its address (the door sets ``X-Forwarded-For`` itself).
It also serves the multi-screen page (``/``) and ``/api/stack``, the live panel's view of
the stack (processes, engines' in-flight against their caps, recent placements).

Process control (``POST /api/{kill,restart}/{name}``, the live panel's buttons) is for
the person at the terminal only: a request must be same-origin (its ``Origin`` names
the ``Host`` it was sent to, so a page on another site cannot post it from a visitor's
browser) and carry the per-run control token (``X-Control-Token``), which ``tokenrelay
demo`` prints to its terminal and nowhere else; otherwise 403 with a code.

A POST is never sent twice: a worker that accepted the connection and then failed
(died mid-request) gets 502 back to the client, which retries with its
``Idempotency-Key`` if it wants to; only a refused connection, when no byte of the
request left, moves on to the next worker. Error bodies carry a code and a short
reason; the upstream's address and the exception go to the log.

This is a demo ingress, not a production one: in production use nginx or Envoy
(deploy/nginx.conf is the docker-compose example).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict

from relay.service.register import refuse_unrouted
from relay.service.routes import Kind, Route, public_by_path, select

__all__ = ["CONTROL_HEADER", "FrontDoor", "make_frontdoor_app", "same_origin", "sendable_close"]

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection and are not forwarded,
# in either direction (nor the headers a Connection header names); nor are Host and
# Content-Length, which the next hop sets itself.
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
# This door is the first proxy a request meets: what a client claims about the addresses
# before it is not believed. The upstreams trust 127.0.0.1 (this door) to name the client;
# a client's own X-Forwarded-For passed on would let it pick its address, and so escape
# its per-address limits. The door sets X-Forwarded-For to the peer it sees.
NOT_FORWARDED = frozenset(
    h.lower()
    for h in ("X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Forwarded", "X-Real-IP")
)
# A WebSocket's handshake is made again by the door's own client (its key, version and
# extensions): the browser's handshake headers are for the door only.
WS_HANDSHAKE = frozenset(
    h.lower()
    for h in (
        "Sec-WebSocket-Key",
        "Sec-WebSocket-Version",
        "Sec-WebSocket-Extensions",
        "Sec-WebSocket-Protocol",
    )
)
SERVICE_RESTART = 1012  # RFC 6455 7.4.1 (IANA registry): "come back later", the client retries
CONTROL_HEADER = "X-Control-Token"
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})

StackView = Callable[[], Any]
Control = Callable[[str, str], Any]


def same_origin(request: web.Request) -> bool:
    """True when the browser says the request comes from the page it is sent to: an
    ``Origin`` whose host[:port] is the request's ``Host`` (and, where the browser sends
    it, ``Sec-Fetch-Site: same-origin``). No ``Origin`` at all is not same-origin."""
    origin = request.headers.get("Origin", "")
    scheme, sep, authority = origin.partition("://")
    host = request.headers.get("Host", "")
    if not sep or scheme not in ("http", "https") or not host:
        return False
    if authority.lower() != host.lower():
        return False
    return request.headers.get("Sec-Fetch-Site", "same-origin") == "same-origin"


def sendable_close(code: int | None) -> int:
    """The close code to send a client for the upstream's ``code``: the upstream's own
    when a close frame may carry it (1000-1003, 1007-1014, 3000-4999), else
    :data:`SERVICE_RESTART` (no close frame came: the relay died or the socket broke;
    RFC 6455 7.4.1 forbids sending 1005, 1006 and 1015, and 1004 is reserved)."""
    if code is not None and (1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999):
        return code
    return SERVICE_RESTART


def _error(status: int, code: str, reason: str) -> web.Response:
    return web.json_response({"error": code, "reason": reason}, status=status)


class FrontDoor:
    def __init__(
        self,
        relays: Callable[[], Sequence[str]],
        workers: Callable[[], Sequence[str]],
        *,
        stack_view: StackView | None = None,
        control: Control | None = None,
        control_token: str | None = None,
    ) -> None:
        self._relays = relays
        self._workers = workers
        self._stack_view = stack_view
        self._control = control
        # per run: given, or made here; whoever starts the door prints it to its terminal
        self.control_token = control_token or secrets.token_urlsafe(24)
        self.http: aiohttp.ClientSession | None = None

    def _order(self, urls: Sequence[str]) -> list[str]:
        shuffled = list(urls)
        random.shuffle(shuffled)
        return shuffled

    def _headers(self, request: web.Request, *, websocket: bool = False) -> CIMultiDict[str]:
        """The request's end-to-end headers, as a reverse proxy forwards them: every
        header but the hop-by-hop ones (and those the ``Connection`` header names), the
        client's claims about addresses, and (for a WebSocket) the browser's handshake;
        then ``X-Forwarded-For``: the peer this door sees. Repeated headers stay repeated."""
        named = {
            token.strip().lower()
            for value in request.headers.getall("Connection", ())
            for token in value.split(",")
        }
        drop = HOP_HEADERS | NOT_FORWARDED | named | (WS_HANDSHAKE if websocket else frozenset())
        out: CIMultiDict[str] = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in drop
        )
        out["X-Forwarded-For"] = request.remote or ""
        return out

    @staticmethod
    def _response_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
        """The upstream's answer headers less the hop-by-hop ones (and those its
        ``Connection`` names); repeated ones (``Set-Cookie``) stay repeated."""
        named = {
            token.strip().lower()
            for value in upstream.headers.getall("Connection", ())
            for token in value.split(",")
        }
        drop = HOP_HEADERS | named
        return CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in drop)

    async def _open(
        self, request: web.Request, upstreams: Sequence[str], body: bytes | None
    ) -> aiohttp.ClientResponse | web.Response:
        """The first upstream's answer; the next upstream is tried when the connection
        was refused, or (idempotent methods only) when it failed after being made."""
        assert self.http is not None
        idempotent = request.method in IDEMPOTENT
        for base in self._order(upstreams):
            try:
                return await self.http.request(
                    request.method,
                    base + request.rel_url.path_qs,
                    headers=self._headers(request),
                    data=body,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=2),
                )
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # the connection was never made, so nothing was sent: try the next
                log.info("upstream %s refused %s: %r", base, request.method, exc)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                log.warning("upstream %s failed %s %s: %r", base, request.method, request.path, exc)
                if not idempotent:  # it may have acted on the request: never send it twice
                    return _error(502, "upstream_failed", "the upstream failed mid-request")
        return _error(502, "no_upstream", "no upstream answered")

    async def proxy_http(
        self, request: web.Request, upstreams: Sequence[str]
    ) -> web.StreamResponse:
        body = await request.read() if request.can_read_body else None
        upstream = await self._open(request, upstreams, body)
        if isinstance(upstream, web.Response):
            return upstream
        try:
            resp = web.StreamResponse(
                status=upstream.status, headers=self._response_headers(upstream)
            )
            await resp.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)  # unbuffered: every chunk as it arrives
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                return resp  # the upstream died mid-stream: end ours, the client resumes
            with contextlib.suppress(ConnectionResetError):
                await resp.write_eof()
            return resp
        finally:
            upstream.release()

    async def proxy_ws(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        offered = [p.strip() for v in request.headers.getall("Sec-WebSocket-Protocol", ())
                   for p in v.split(",") if p.strip()]  # fmt: skip
        for base in self._order(self._relays()):
            url = base.replace("http", "ws", 1) + request.rel_url.path_qs
            try:
                upstream = await self.http.ws_connect(
                    url,
                    headers=self._headers(request, websocket=True),
                    protocols=offered,
                    timeout=aiohttp.ClientWSTimeout(ws_close=5),
                )
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 503:  # draining or full: another relay may take it
                    continue
                # the relay's own answer (400 bad session, 401/403 token, ...), passed on
                return _error(exc.status, "refused_by_relay", exc.message)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                log.info("relay %s: websocket failed: %r", base, exc)
                continue
            break
        else:
            return _error(502, "no_upstream", "no relay took the stream")
        chosen = (upstream.protocol,) if upstream.protocol else ()
        client = web.WebSocketResponse(max_msg_size=64 * 1024, protocols=chosen)
        await client.prepare(request)

        async def down() -> None:
            async for msg in upstream:
                if msg.type == WSMsgType.TEXT:
                    await client.send_str(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await client.send_bytes(msg.data)
            code = sendable_close(upstream.close_code)
            await client.close(code=code, message=b"relay closed")

        async def up() -> None:
            async for msg in client:
                if msg.type == WSMsgType.TEXT:
                    await upstream.send_str(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await upstream.send_bytes(msg.data)
            await upstream.close()

        tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not client.closed:
                await client.close(code=sendable_close(upstream.close_code), message=b"relay gone")
            await upstream.close()
        return client

    # -- handlers -----------------------------------------------------------------
    async def proxy(self, routes: Sequence[Route], request: web.Request) -> web.StreamResponse:
        """A table route's request (``routes``: the table's routes of its path): to the
        service :func:`relay.service.routes.select` picks (a Responses stream,
        ``?stream=true``, from a relay, which serves any response from the backlog and
        live; the object from a worker), a WebSocket's handshake through :meth:`proxy_ws`."""
        route = select(routes, request.method, request.query)
        if route is None:  # the resource holds only its routes' methods: not reached
            return _error(405, "method_not_allowed", "no route of this path takes it")
        if route.kind is Kind.WEBSOCKET and request.method == "GET":
            return await self.proxy_ws(request)
        upstreams = self._relays() if route.service == "relay" else self._workers()
        return await self.proxy_http(request, upstreams)

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def stack(self, request: web.Request) -> web.Response:
        view = self._stack_view() if self._stack_view else {}
        if asyncio.iscoroutine(view):
            view = await view
        return web.json_response(view)

    async def control(self, request: web.Request) -> web.Response:
        if self._control is None:
            return _error(404, "not_found", "no process control in this front door")
        if not same_origin(request):
            return _error(403, "cross_origin", "process control takes same-origin requests only")
        given = request.headers.get(CONTROL_HEADER, "").encode()
        if not hmac.compare_digest(given, self.control_token.encode()):
            return _error(403, "bad_control_token", "needs the control token from the terminal")
        action, name = request.match_info["action"], request.match_info["name"]
        try:
            result = self._control(action, name)
            if asyncio.iscoroutine(result):
                result = await result
        except KeyError:
            return _error(404, "no_such_process", "no process of that name")
        except (ValueError, RuntimeError) as exc:
            log.warning("control %s %s failed: %r", action, name, exc)
            return _error(400, "control_failed", f"cannot {action} that process")
        return web.json_response({"ok": True, "action": action, "name": name, "result": result})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready when some relay and some worker answer their own ``/readyz``; the body
        counts them (their addresses are internal: they stay out of answers)."""
        assert self.http is not None
        ready: dict[str, list[str]] = {"relays": [], "workers": []}
        for kind, bases in (("relays", self._relays()), ("workers", self._workers())):
            for base in bases:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                    async with self.http.get(
                        base + "/readyz", timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        if resp.status == 200:
                            ready[kind].append(base)
        ok = bool(ready["relays"]) and bool(ready["workers"])
        counts = {kind: len(bases) for kind, bases in ready.items()}
        return web.json_response({"ready": ok, **counts}, status=200 if ok else 503)

    async def on_startup(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(auto_decompress=False)

    async def on_cleanup(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()


def make_frontdoor_app(door: FrontDoor) -> web.Application:
    # bodies as large as a relay takes for a Durable Streams write by default
    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_get("/", door.index)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=True)  # tokenrelay.js
    app.router.add_get("/healthz", door.healthz)
    app.router.add_get("/readyz", door.readyz)
    app.router.add_get("/api/stack", door.stack)
    app.router.add_post("/api/{action}/{name}", door.control)
    # every route of the table a door proxies (relay/service/routes.py), one resource
    # per path: the relays' streams and Durable Streams, the workers' API
    for path, routes in public_by_path().items():
        resource = app.router.add_resource(path)
        for method in dict.fromkeys(m for r in routes for m in r.methods):
            resource.add_route(method, functools.partial(door.proxy, routes))
    # what no route takes: 404 / 405 in the refusal shape of the path's front, as the
    # relays and workers answer it (relay.service.register)
    refuse_unrouted(app)
    app.on_startup.append(door.on_startup)
    app.on_cleanup.append(door.on_cleanup)
    return app
