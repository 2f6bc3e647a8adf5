"""A listening site whose connections cannot outstay their welcome: a deadline on every
request head and body, an idle keep-alive timeout, and a cap on connections per address.

aiohttp waits as long as a client likes for a request head or body that is never
finished, and keeps an idle keep-alive connection for an hour (its ``keepalive_timeout``
is 3630 s unless a runner says otherwise, and it ends a connection without a word or
a count). A client that sends ``GET / HTTP/1.1\\r\\nHost: x\\r\\n`` and stops, or sends
one request and then nothing, or declares ``Content-Length: 60000`` and sends a byte a
second, holds a socket and a file descriptor; from one address, enough of them take all
of a process's descriptors (``max_connections`` cannot help: it counts streams, and
none of these is one).

:class:`GuardedSite` is a :class:`aiohttp.web.TCPSite` look-alike whose protocol factory
wraps aiohttp's per-connection protocol in :class:`GuardedConn`, which reads every byte
through :class:`relay.service.httpframing.Framing` before passing it on unchanged, and
holds each part of each request to its deadline (:class:`ConnLimits`):

- **head**: a request head (request line and headers, to the empty line) must be
  complete ``head_timeout_s`` after its first byte (the first head of a connection:
  after the connection opened); else ``408`` with ``request head not received in
  time`` and the connection is closed;
- **body**: a body the head declared (``Content-Length`` or chunked) must be complete
  ``body_timeout_s`` after the head; else ``408`` ``request body not received in
  time`` (or, when its response has started, no answer) and the connection closed.
  Read or not by its handler: aiohttp would otherwise read an unread body on for 10 s
  (its lingering time) and an awaited one forever;
- **idle**: a keep-alive connection with no request being answered must start its
  next request within ``keepalive_timeout_s`` of its last response's end; else it is
  closed without an answer (as HTTP lets a server close an idle connection);
- **per address**: at most ``max_per_address`` connections from one peer address at
  once (0: no cap; the peers in ``exempt``, trusted proxies, are not counted: they
  carry many clients); the next gets ``429`` with ``{"error":
  "too_many_connections"}`` and ``Retry-After: 1`` and is closed before anything of it
  is read.

Nothing is timed while a request is being answered, so an SSE or WebSocket stream, or a
turn waiting for its engine, is never cut by these deadlines. When a response ends is
learnt from aiohttp's public ``on_response_prepare`` signal (:meth:`ConnGuard.install`
adds it to the app): the task that prepares a response is the request's, and when that
task is done the response has been written to its end. A handler that hands its socket
to another protocol (the relay's streams) calls :func:`detach_guard`: from then on the
connection is the stream's (the stream limits count it), not this guard's.

Every refusal and close is counted through ``count(reason)``, with the reasons of
:class:`Reason`; ``body_cut`` counts clients that left mid-body, which are not logged
(their handler's read raises ``ConnectionResetError`` and answers :func:`client_gone`).

Order of use::

    guard_app(app, ConnLimits(head_timeout_s=10, max_per_address=512),   # app[GUARD]
              count=lambda reason: metrics.http_guard.labels(reason).inc())
    runner = make_runner(app); await runner.setup()     # after: the app is frozen
    site = GuardedSite(runner, "127.0.0.1", 8080, guard=app[GUARD], backlog=4096)
    await site.start(); ...; await runner.cleanup()
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

from aiohttp import web
from yarl import URL

from relay.protocol.codes import Refusal
from relay.service.httpframing import Deadline, Framing, State

__all__ = [
    "GUARD",
    "HEAD_TIMEOUT_RESPONSE",
    "TIMEOUT_RESPONSE",
    "TOO_MANY_RESPONSE",
    "ConnGuard",
    "ConnLimits",
    "GuardedConn",
    "GuardedSite",
    "Reason",
    "address_key",
    "client_gone",
    "detach_guard",
    "guard_app",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Reason(enum.StrEnum):
    """The label of a counted refusal or close."""

    HEAD_TIMEOUT = "head_timeout"  # 408: the head did not arrive in time
    BODY_TIMEOUT = "body_timeout"  # 408: the body did not arrive in time
    IDLE_TIMEOUT = "idle_timeout"  # closed: idle past the keep-alive timeout
    TOO_MANY_CONNECTIONS = "too_many_connections"  # 429: the address's cap reached
    BODY_CUT = "body_cut"  # the client left before its body ended (nothing is logged)


def _response(status: str, content_type: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 %s\r\nConnection: close\r\nContent-Type: %s\r\n%sContent-Length: %d\r\n\r\n%s"
        % (status.encode(), content_type.encode(), extra, len(body), body)
    )


_TEXT: Final = "text/plain; charset=utf-8"
HEAD_TIMEOUT_RESPONSE: Final = _response(
    "408 Request Timeout", _TEXT, b"request head not received in time\n"
)
TIMEOUT_RESPONSE: Final = HEAD_TIMEOUT_RESPONSE  # the name it had before bodies were timed
BODY_TIMEOUT_RESPONSE: Final = _response(
    "408 Request Timeout", _TEXT, b"request body not received in time\n"
)
TOO_MANY_RESPONSE: Final = _response(
    "429 Too Many Requests",
    "application/json",
    b'{"error":"%s","reason":"too many connections from this address"}'
    % Refusal.TOO_MANY_CONNECTIONS.value.encode(),
    b"Retry-After: 1\r\n",
)


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """The deadlines (seconds, each > 0) and the per-address cap (0: none)."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    max_per_address: int = 0
    exempt: tuple[Network, ...] = ()  # peers not counted against the cap

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_per_address < 0:
            raise ValueError("max_per_address must be >= 0")

    def seconds(self, deadline: Deadline) -> float:
        if deadline is Deadline.HEAD:
            return self.head_timeout_s
        if deadline is Deadline.BODY:
            return self.body_timeout_s
        return self.keepalive_timeout_s


def address_key(peer: Any, exempt: tuple[Network, ...] = ()) -> str | None:
    """The address a connection counts against (an IPv4-mapped IPv6 address as its
    IPv4 one), from a transport's ``peername``; None for an exempt or unknown peer."""
    host = peer[0] if isinstance(peer, tuple) and peer else None
    if not isinstance(host, str):
        return None
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in net for net in exempt):
        return None
    return str(ip)


def client_gone() -> web.Response:
    """What a handler answers when reading its body raised ``ConnectionResetError`` (what
    aiohttp sets on a body whose client left): nobody reads it, the guard has counted
    ``body_cut``, and nothing is logged. Raising instead would have aiohttp log an
    ERROR with a traceback, one per client that hangs up."""
    return web.Response(status=400)


class ConnGuard:
    """What one app's connections share: the limits, the per-address counts, the count
    callback, and which connection each live transport is (for the response ends)."""

    __slots__ = ("_conns", "_count", "_per_address", "installed", "limits")

    def __init__(self, limits: ConnLimits, count: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self._count = count
        self._per_address: dict[str, int] = {}
        self._conns: dict[object, GuardedConn] = {}
        self.installed = False

    def install(self, app: web.Application) -> None:
        """Learn when the app's responses end (its ``on_response_prepare`` signal); call
        it before the app is frozen (``runner.setup()``)."""
        app.on_response_prepare.append(self._on_prepare)
        self.installed = True

    def connections(self, address: str) -> int:
        """Connections held now from ``address`` (as :func:`address_key` names it)."""
        return self._per_address.get(address, 0)

    def count(self, reason: Reason) -> None:
        if self._count is not None:
            self._count(reason.value)

    def _take(self, transport: asyncio.BaseTransport) -> tuple[bool, str | None]:
        """(admitted, the address counted); not admitted past the address's cap."""
        key = address_key(transport.get_extra_info("peername"), self.limits.exempt)
        if key is None or not self.limits.max_per_address:
            return True, None
        held = self._per_address.get(key, 0)
        if held >= self.limits.max_per_address:
            return False, None
        self._per_address[key] = held + 1
        return True, key

    def _release(self, key: str | None) -> None:
        if key is None:
            return
        held = self._per_address.get(key, 0) - 1
        if held > 0:
            self._per_address[key] = held
        else:
            self._per_address.pop(key, None)

    async def _on_prepare(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        conn = self._conns.get(request.transport)
        if conn is not None:
            conn.responding()


class GuardedConn(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the deadlines and the cap of its
    :class:`ConnGuard` (see the module docstring)."""

    __slots__ = (
        "_address", "_closed", "_deadline", "_framing", "_guard", "_inner", "_make_inner",
        "_responding", "_timer", "_transport",
    )  # fmt: skip

    def __init__(self, guard: ConnGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._framing: Framing | None = Framing()
        self._address: str | None = None
        self._deadline: Deadline | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._responding = 0  # responses prepared whose task has not ended
        self._closed: Reason | None = None  # why this guard closed the connection

    # -- the transport's events ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport has the Transport methods without subclassing it
        t = self._transport = cast(asyncio.Transport, transport)
        admitted, self._address = self._guard._take(transport)
        if not admitted:
            self._closed = Reason.TOO_MANY_CONNECTIONS
            self._framing = None
            self._guard.count(Reason.TOO_MANY_CONNECTIONS)
            t.write(TOO_MANY_RESPONSE)
            t.close()
            return
        self._guard._conns[transport] = self
        inner = self._inner = self._make_inner()
        self._retime()
        inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is None:
            return  # refused: nothing is read
        framing = self._framing
        if framing is not None:
            framing.feed(data)
            self._retime()
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        inner = self._inner
        if inner is None:
            return
        framing = self._framing
        if framing is not None and framing.state is State.BODY and self._closed is None:
            self._guard.count(Reason.BODY_CUT)
        self._forget()
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # -- what the app tells it -------------------------------------------------------------

    def responding(self) -> None:
        """A response of this connection is being prepared, in its request's task."""
        task = asyncio.current_task()
        if task is None or self._framing is None:
            return
        self._responding += 1
        task.add_done_callback(self._response_done)

    def detach(self) -> None:
        """The connection is handed to another protocol (a stream): no deadline, no
        count against its address from now on."""
        self._forget()
        self._inner = None

    # -- inside ----------------------------------------------------------------------------

    def _response_done(self, task: asyncio.Task[Any]) -> None:
        self._responding -= 1
        framing = self._framing
        if framing is not None:
            framing.response_done()
            self._retime()

    def _retime(self) -> None:
        """Run the timer of the deadline that applies now (a running one is kept: a
        head's deadline counts from its first byte, not its last)."""
        framing = self._framing
        deadline = framing.deadline() if framing is not None else None
        if deadline is self._deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deadline = deadline
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(
                self._guard.limits.seconds(deadline), self._expired, deadline
            )

    def _expired(self, deadline: Deadline) -> None:
        self._timer = None
        self._deadline = None
        t, framing = self._transport, self._framing
        if t is None or framing is None or t.is_closing():
            return
        if deadline is Deadline.HEAD:
            reason, answer = Reason.HEAD_TIMEOUT, HEAD_TIMEOUT_RESPONSE
            unanswered = framing.inflight == 0  # a 408 would not be taken for another's
        elif deadline is Deadline.BODY:
            reason, answer = Reason.BODY_TIMEOUT, BODY_TIMEOUT_RESPONSE
            unanswered = framing.inflight == 1 and not self._responding
        else:
            reason, answer, unanswered = Reason.IDLE_TIMEOUT, b"", False
        self._closed = reason
        self._guard.count(reason)
        if unanswered:
            t.write(answer)
        t.close()  # flushes the answer; then connection_lost reaches aiohttp

    def _forget(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        guard = self._guard
        if self._transport is not None:
            guard._conns.pop(self._transport, None)
        guard._release(self._address)
        self._address = None
        self._framing = None
        self._transport = None


GUARD: Final = web.AppKey("tokenrelay_http_guard", ConnGuard)


def guard_app(
    app: web.Application, limits: ConnLimits, count: Callable[[str], None] | None = None
) -> ConnGuard:
    """A :class:`ConnGuard` installed on ``app`` and kept as ``app[GUARD]``, for the
    :class:`GuardedSite` that serves it."""
    guard = ConnGuard(limits, count)
    guard.install(app)
    app[GUARD] = guard
    return guard


def detach_guard(transport: asyncio.BaseTransport) -> None:
    """Call before ``transport.set_protocol(...)`` hands a guarded connection to
    another protocol: its guard lets go of it (nothing happens for another protocol)."""
    conn = transport.get_protocol()
    if isinstance(conn, GuardedConn):
        conn.detach()


class GuardedSite(web.BaseSite):
    """A TCP site (like :class:`aiohttp.web.TCPSite`, without TLS) whose connections are
    wrapped in :class:`GuardedConn`. ``port=0`` binds a free port (see ``port``)."""

    __slots__ = ("_bound_port", "_guard", "_host", "_port", "_reuse")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        guard: ConnGuard,
        backlog: int = 4096,
        reuse_address: bool = True,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._bound_port: int | None = None
        self._guard = guard
        self._reuse = reuse_address

    @property
    def port(self) -> int:
        return self._bound_port if self._bound_port is not None else self._port

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    async def start(self) -> None:
        if not self._guard.installed:
            raise RuntimeError("ConnGuard.install(app) must run before the runner is set up")
        await super().start()
        server = self._runner.server
        assert server is not None
        guard = self._guard

        def protocol() -> asyncio.Protocol:
            return GuardedConn(guard, server)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
