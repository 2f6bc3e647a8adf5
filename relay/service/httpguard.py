"""A listening site whose connections must send their request head in time.

aiohttp waits forever for a request that is never finished: a client that sends
``GET / HTTP/1.1\\r\\nHost: x\\r\\n`` and stops holds a socket and a file descriptor
for as long as it likes (slowloris). ``max_connections`` cannot help, it counts
streams, and a stream only exists once the head has arrived.

:class:`GuardedSite` is a :class:`aiohttp.web.TCPSite` look-alike whose protocol
factory wraps aiohttp's per-connection protocol in :class:`HeadDeadline`: if the first
request head (request line and headers, up to the blank line) has not arrived within
``head_timeout_s`` of the connection opening, the connection gets ``408 Request
Timeout`` with a one-line reason and is closed. Everything else is passed through
unchanged, so the SSE and WebSocket streams that follow a head are never timed. Later
heads on a keep-alive connection are left to aiohttp's ``keepalive_timeout``.

Order of use::

    runner = make_runner(app); await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 8080, head_timeout_s=10.0, backlog=4096,
                       on_timeout=lambda: metrics.rejected.labels("head_timeout").inc())
    await site.start(); ...; await runner.cleanup()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

from aiohttp import web
from yarl import URL

__all__ = ["TIMEOUT_RESPONSE", "GuardedSite", "HeadDeadline"]

_REASON: Final = b"request head not received in time\n"
TIMEOUT_RESPONSE: Final = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_REASON), _REASON)
)


class HeadDeadline(asyncio.Protocol):
    """Forwards every protocol event to ``inner``; answers 408 and closes the connection
    if no complete request head (a blank line: ``\\n\\r\\n`` or ``\\n\\n``) arrived
    within ``timeout_s`` of ``connection_made``."""

    __slots__ = ("_inner", "_on_timeout", "_tail", "_timeout_s", "_timer", "_transport")

    def __init__(
        self,
        inner: asyncio.Protocol,
        timeout_s: float,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        self._inner = inner
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport has the Transport methods without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._timeout_s, self._expired)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            seen = self._tail + data
            if b"\n\r\n" in seen or b"\n\n" in seen:
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = seen[-2:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _expired(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._on_timeout is not None:
            self._on_timeout()
        transport.write(TIMEOUT_RESPONSE)
        transport.close()  # flushes the 408, then connection_lost reaches aiohttp


class GuardedSite(web.BaseSite):
    """A TCP site (like :class:`aiohttp.web.TCPSite`, without TLS) whose connections
    are wrapped in :class:`HeadDeadline`. ``port=0`` binds a free port (see ``port``)."""

    __slots__ = ("_bound_port", "_head_timeout_s", "_host", "_on_timeout", "_port", "_reuse")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        head_timeout_s: float = 10.0,
        backlog: int = 4096,
        reuse_address: bool = True,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        if head_timeout_s <= 0:
            raise ValueError("head_timeout_s must be > 0")
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._bound_port: int | None = None
        self._head_timeout_s = head_timeout_s
        self._reuse = reuse_address
        self._on_timeout = on_timeout

    @property
    def port(self) -> int:
        return self._bound_port if self._bound_port is not None else self._port

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.Protocol:
            return HeadDeadline(server(), self._head_timeout_s, self._on_timeout)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
