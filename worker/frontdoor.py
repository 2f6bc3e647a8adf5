"""The demo's front door: one URL for the whole HTTP contract, no stickiness.

Edge paths (``/v1/sessions/{sid}/events``, ``/v1/sessions/{sid}/ws``) go to a relay,
session and turn paths (``POST /v1/sessions``, ``POST /v1/sessions/{sid}/turns``) to a
worker; each request picks an upstream at random (a client that reconnects lands
anywhere, which is the point) and tries the next one when an upstream refuses the
connection. Streams pass through unbuffered, WebSocket close codes pass through.
It also serves the multi-screen page (``/``) and ``/api/stack``, the live panel's view of
the stack (processes, engines' in-flight against their caps, recent placements).

This is a demo ingress, not a production one: in production use nginx or Envoy
(docker-compose.yml has an nginx example).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

__all__ = ["FrontDoor", "make_frontdoor_app"]

STATIC_DIR = Path(__file__).with_name("static")
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
FORWARD_REQUEST_HEADERS = ("Authorization", "Last-Event-ID", "Idempotency-Key", "Content-Type")

StackView = Callable[[], Any]
Control = Callable[[str, str], Any]


class FrontDoor:
    def __init__(
        self,
        relays: Callable[[], Sequence[str]],
        workers: Callable[[], Sequence[str]],
        *,
        stack_view: StackView | None = None,
        control: Control | None = None,
    ) -> None:
        self._relays = relays
        self._workers = workers
        self._stack_view = stack_view
        self._control = control
        self.http: aiohttp.ClientSession | None = None

    def _order(self, urls: Sequence[str]) -> list[str]:
        shuffled = list(urls)
        random.shuffle(shuffled)
        return shuffled

    def _headers(self, request: web.Request) -> dict[str, str]:
        out = {h: request.headers[h] for h in FORWARD_REQUEST_HEADERS if h in request.headers}
        out["X-Forwarded-For"] = request.remote or ""
        return out

    async def _open(
        self, request: web.Request, upstreams: Sequence[str], body: bytes | None
    ) -> aiohttp.ClientResponse:
        assert self.http is not None
        last_error = "no upstream configured"
        for base in self._order(upstreams):
            try:
                return await self.http.request(
                    request.method,
                    base + request.rel_url.path_qs,
                    headers=self._headers(request),
                    data=body,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=2),
                )
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last_error = f"{base}: {exc}"
        raise web.HTTPBadGateway(
            text=f'{{"error": "no upstream answered", "reason": "{last_error}"}}',
            content_type="application/json",
        )

    async def proxy_http(
        self, request: web.Request, upstreams: Sequence[str]
    ) -> web.StreamResponse:
        body = await request.read() if request.can_read_body else None
        upstream = await self._open(request, upstreams, body)
        try:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            resp = web.StreamResponse(status=upstream.status, headers=headers)
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
        last_error = "no relay configured"
        for base in self._order(self._relays()):
            url = base.replace("http", "ws", 1) + request.rel_url.path_qs
            try:
                upstream = await self.http.ws_connect(
                    url, headers=self._headers(request), timeout=aiohttp.ClientWSTimeout(ws_close=5)
                )
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status == 503:  # draining or full: another relay may take it
                    last_error = f"{base}: 503 {exc.message}"
                    continue
                # the relay's own answer (400 bad session, 401/403 token, ...), passed on
                return web.json_response(
                    {"error": "refused by relay", "reason": exc.message}, status=exc.status
                )
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last_error = f"{base}: {exc}"
                continue
            break
        else:
            raise web.HTTPBadGateway(text=last_error)
        client = web.WebSocketResponse(max_msg_size=64 * 1024)
        await client.prepare(request)

        async def down() -> None:
            async for msg in upstream:
                if msg.type == WSMsgType.TEXT:
                    await client.send_str(msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await client.send_bytes(msg.data)
            code = upstream.close_code or 1011
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
                await client.close(code=upstream.close_code or 1012, message=b"relay gone")
            await upstream.close()
        return client

    # -- handlers -----------------------------------------------------------------
    async def events(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy_http(request, self._relays())

    async def to_worker(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy_http(request, self._workers())

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def stack(self, request: web.Request) -> web.Response:
        view = self._stack_view() if self._stack_view else {}
        if asyncio.iscoroutine(view):
            view = await view
        return web.json_response(view)

    async def control(self, request: web.Request) -> web.Response:
        if self._control is None:
            raise web.HTTPNotFound(text="no process control in this front door")
        action, name = request.match_info["action"], request.match_info["name"]
        try:
            result = self._control(action, name)
            if asyncio.iscoroutine(result):
                result = await result
        except (KeyError, ValueError, RuntimeError) as exc:
            return web.json_response({"error": "control failed", "reason": str(exc)}, status=400)
        return web.json_response({"ok": True, "action": action, "name": name, "result": result})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready when some relay and some worker answer their own ``/readyz``."""
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
        return web.json_response({"ready": ok, **ready}, status=200 if ok else 503)

    async def on_startup(self, app: web.Application) -> None:
        self.http = aiohttp.ClientSession(auto_decompress=False)

    async def on_cleanup(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()


def make_frontdoor_app(door: FrontDoor) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024)
    app.router.add_get("/", door.index)
    app.router.add_static("/static/", STATIC_DIR, follow_symlinks=True)  # tokenrelay.js
    app.router.add_get("/healthz", door.healthz)
    app.router.add_get("/readyz", door.readyz)
    app.router.add_get("/api/stack", door.stack)
    app.router.add_post("/api/{action}/{name}", door.control)
    app.router.add_get("/v1/sessions/{sid}/events", door.events)
    app.router.add_get("/v1/sessions/{sid}/ws", door.proxy_ws)
    app.router.add_post("/v1/sessions", door.to_worker)
    app.router.add_route("*", "/v1/sessions/{sid}/turns", door.to_worker)
    # The Vercel AI SDK: its chat POST to a worker, its resume GET (and ui-stream) to a relay.
    app.router.add_post("/v1/chat", door.to_worker)
    app.router.add_get("/v1/chat/{sid}/stream", door.events)
    app.router.add_get("/v1/sessions/{sid}/ui-stream", door.events)
    app.on_startup.append(door.on_startup)
    app.on_cleanup.append(door.on_cleanup)
    return app
